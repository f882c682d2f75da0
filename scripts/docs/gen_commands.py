#!/usr/bin/env python3
"""docs/COMMANDS.md: the complete command reference, generated from every command's `--help`.

Usage (from the repository root): python3 -m scripts.docs.gen_commands [--check]   (--check: exit 1 if docs/COMMANDS.md is out of date)
tests/test_docs.py fails when the file differs from what this prints, so the reference cannot drift.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "COMMANDS.md"
WIDTH = 100


def _walk(cmd: click.Command, path: list[str], ctx_parent: click.Context | None):  # type: ignore[no-untyped-def]
    ctx = click.Context(cmd, info_name=path[-1], parent=ctx_parent, terminal_width=WIDTH, max_content_width=WIDTH)
    yield path, cmd, ctx
    if isinstance(cmd, click.Group):
        loader = getattr(cmd, "load_all", None)
        subs = loader() if loader else {n: cmd.get_command(ctx, n) for n in cmd.list_commands(ctx)}
        for name, sub in subs.items():
            if sub is not None and not sub.hidden:
                yield from _walk(sub, [*path, name], ctx)


def render() -> str:
    os.environ.setdefault("GPUSNAP_STORE", "/var/lib/gpusnap")  # the defaults shown do not depend on who runs this
    from cli import main
    parts = ["# Command reference", "",
             "Generated from `gpusnap ... --help` by `scripts/docs/gen_commands.py`; do not edit by hand",
             "(`python3 -m scripts.docs.gen_commands > docs/COMMANDS.md` after changing a command; a test",
             "fails while this file and the commands disagree). The user guide is `docs/GUIDE.md`.", ""]
    entries = list(_walk(main, ["gpusnap"], None))
    parts.append("## Contents")
    parts += [f"- [`{' '.join(p)}`](#{'-'.join(p)})" for p, _, _ in entries]
    for path, cmd, ctx in entries:
        parts += ["", f'<a id="{"-".join(path)}"></a>', f"## `{' '.join(path)}`", "", "```text",
                  cmd.get_help(ctx).rstrip(), "```"]
    return "\n".join(parts) + "\n"


def main_() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    text = render()
    if a.check:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    sys.stdout.write(text)


if __name__ == "__main__":
    main_()
