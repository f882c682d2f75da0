#!/usr/bin/env python3
"""What a py-spy raw profile (`py-spy record -f raw [--threads]`) says, in a few lines: the samples per
thread name prefix, and the functions most often on the stack or at its top.

    python3 -m scripts.bench.spy_summary PROFILE.txt[.xz] [--match as_delta] [--top 15]

Each line of a raw profile is `frame;frame;...;frame COUNT` (with --threads the first frame names the
thread). --match keeps only the stacks through a frame containing that text (e.g. the second dump's
delta work); "on stack" counts a function once per sample wherever it is in the stack, "top" counts
the innermost frame: with --gil the samples are the moments a thread held the GIL.
"""
from __future__ import annotations

import argparse
import collections
import lzma
import re

_LOC = re.compile(r" \(.*\)$")


def parse(path: str) -> list[tuple[list[str], int]]:
    out = []
    with (lzma.open(path, "rt") if path.endswith(".xz") else open(path)) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack and n.isdigit():
                out.append((stack.split(";"), int(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--match", default="")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    rows = [(s, n) for s, n in parse(a.profile) if not a.match or any(a.match in f for f in s)]
    total = sum(n for _, n in rows)
    threads: collections.Counter[str] = collections.Counter()
    on: collections.Counter[str] = collections.Counter()
    top: collections.Counter[str] = collections.Counter()
    for s, n in rows:
        name = s[0].split(":", 1)[1].strip() if s[0].startswith("thread") and ":" in s[0] else "?"
        threads[re.sub(r"[_-]?\d+$", "", name)] += n  # gpusnap-put_3 -> gpusnap-put
        for f in {_LOC.sub("", f) for f in s[1:]}:
            on[f] += n
        top[_LOC.sub("", s[-1])] += n
    print(f"{a.profile}: {total} samples{' through ' + a.match if a.match else ''}")
    print("threads:", dict(threads.most_common(8)))
    for title, c in (("on stack", on), ("top of stack", top)):
        print(f"{title}:")
        for f, n in c.most_common(a.top):
            print(f"  {n:7d} {100 * n / max(1, total):5.1f}%  {f}")


if __name__ == "__main__":
    main()
