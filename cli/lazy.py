"""A click group whose commands are imported only when one is run or its help is shown.

`gpusnap --help` and `gpusnap store ls` must start fast on a cold page cache: each command module
pulls in what it needs (numpy, zstandard, boto3, rich, the CUDA bindings, pyroute2) only when that
command runs. The short help a group lists is kept beside each entry; tests/test_second_hour.py
checks it is each command's own first docstring line, so the listing cannot drift.
"""
from __future__ import annotations

import importlib
from typing import Any

import click


class LazyGroup(click.Group):
    """LAZY: command name -> (module, attribute, short help)."""

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str, str]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        """The group's own commands in the order they were defined, then the lazy ones in table order."""
        return [n for n in self.commands if n not in self.lazy] + list(self.lazy)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        entry = self.lazy.get(cmd_name)
        if entry is None:
            return None
        module, attr, _ = entry
        cmd: click.Command = getattr(importlib.import_module(module), attr)
        self.commands[cmd_name] = cmd
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The listing of --help, from the short helps kept here (no command module imported)."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max((len(n) for n in names), default=0)  # as click's own listing
        rows = []
        for name in names:
            if name in self.commands:
                c = self.commands[name]
                if c.hidden:
                    continue
                rows.append((name, c.get_short_help_str(limit)))
            else:
                rows.append((name, click.Command(name, help=self.lazy[name][2]).get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def load_all(self) -> dict[str, click.Command]:
        """Every command, imported (the reference generator and the tests use it)."""
        ctx = click.Context(self)
        return {n: self.get_command(ctx, n) for n in self.list_commands(ctx)}  # type: ignore[misc]
