"""The docs' fenced blocks and the shell their commands run in (shared by test_docs.py, which runs the
README's worked examples, and test_guide.py, which runs every command of docs/GUIDE.md): the blocks
as the Markdown has them, the command lines of a block as a user types them, and the environment in
which `gpusnap` is this checkout's CLI with the project's CRIU first on PATH."""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO, pythonpath

# `gpusnap` in the docs' shell: this checkout's CLI, run by the test's interpreter
GPUSNAP_FUNCTION = f'gpusnap() {{ "{sys.executable}" -m cli "$@"; }}\n'

_FENCE = re.compile(r"(?:<!-- test: (\w+) -->\n)?[ \t]*```(\w*)\n(.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    """One fenced block: NAME from a `<!-- test: NAME -->` line before it (or None), its info string
    (LANG: sh, text, ...), BODY as written, the `## ` heading it is under and the line it starts at."""

    name: str | None
    lang: str
    body: str
    heading: str
    line: int


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced block of the Markdown TEXT, in order."""
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()]
        headings = re.findall(r"^## (.+)$", before, re.M)
        out.append(Block(m.group(1), m.group(2), m.group(3), headings[-1] if headings else "",
                         before.count("\n") + 1))
    return out


def _strip_comment(line: str) -> str:
    """LINE without a shell comment (a `#` at the start of a word, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def command_lines(body: str) -> list[str]:
    """The command lines of a block BODY as a shell reads them: continued lines joined, comments and
    blank lines dropped, indentation removed."""
    joined = re.sub(r"[ \t]*\\\n\s*", " ", body)
    return [c for c in (_strip_comment(line.strip()) for line in joined.splitlines()) if c]


def shell_env(store: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the docs' commands run in: this checkout's packages, STORE as the default
    store, and the project's CRIU build (this checkout's, else the main checkout's) first on PATH."""
    return {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_STORE": str(store),
            "PATH": f"{REPO / '.cache' / 'criu' / 'bin'}:/work/main/.cache/criu/bin:{os.environ['PATH']}",
            **(extra or {})}
