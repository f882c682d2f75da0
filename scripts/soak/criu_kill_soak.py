#!/usr/bin/env python3
"""Soak: dump/restore cycles of a small CRIU process tree with gpusnap SIGKILLed at random moments.

Each cycle dumps the tree (scripts/workloads/criu_workload.py: two processes, a thread, a pipe, a file
offset, known memory and a counter) into a store and restores it, through the real `gpusnap` CLI and
the streamed image path with the split fill on (so that a kill can land inside CRIU, the ingest, the
commit, CRIU's restore or the fill). With probability --kill-p each command is SIGKILLed after a
random delay within how long it usually takes; `gpusnap recover` runs after every kill. Then:
- no process of the tree is stopped (state T) or a zombie left holding a pid;
- the tree is never lost: it runs, or its committed snapshot restores it (retried until it does);
- the restored tree is intact (its own memory, pipe, thread and file checks) and its counter has not
  gone back.
Prints one JSON summary; exit 0 only if every cycle held. Needs root and CRIU >= 4 (scripts/setup.sh).

    sudo PATH=.cache/criu/bin:$PATH .venv/bin/python -m scripts.soak.criu_kill_soak --cycles 50   (from the repository root)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.workloads.criu_tree import CriuTree, healthy

REPO = Path(__file__).resolve().parents[2]


class Workload(CriuTree):
    """The criu_workload.py tree, detached (not our child: init reaps it, as for a real workload)."""

    def __init__(self, mb: int) -> None:
        super().__init__(mb, detached=True, prefix="gpusnap-soak-wl-", start_timeout=30)

    def alive(self) -> bool:
        return self.running()

    def gone(self, timeout: float = 10, zombies: bool = True) -> bool:
        return super().gone(timeout, zombies)


@dataclass
class Soak:
    store: Path
    rng: random.Random
    kill_p: float
    env: dict[str, str]
    seconds: dict[str, float] = field(default_factory=lambda: {"dump": 1.0, "restore": 1.0})  # after the record
    kills: dict[str, int] = field(default_factory=lambda: {"dump": 0, "restore": 0})
    recovered: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    retries: int = 0
    failed: list[str] = field(default_factory=list)  # attempts that exited non-zero without a kill (why)

    def gpusnap(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([sys.executable, "-m", "cli", "--store", str(self.store), *args], capture_output=True,
                           text=True, cwd=REPO, env=self.env, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"gpusnap {' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
        return p

    def _journaled(self, p: subprocess.Popen[str]) -> float | None:
        """When P's journal record appeared (its operation began), None if P ended first."""
        journal = self.store / "journal"
        while p.poll() is None:
            if journal.is_dir() and any(n.endswith(".json") and len(n) == 37 for n in os.listdir(journal)):
                return time.monotonic()
            time.sleep(0.003)
        return None

    def attempt(self, what: str, *args: str) -> bool:
        """`gpusnap ARGS`, maybe SIGKILLed at a random moment of its operation (a uniform time after its
        journal record appeared, up to a little past how long the rest usually takes); True if it ran
        to its end (any exit)."""
        kill = self.rng.random() < self.kill_p
        p = subprocess.Popen([sys.executable, "-m", "cli", "--store", str(self.store), *args, "--json"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=REPO, env=self.env, start_new_session=True)
        began = self._journaled(p)
        try:
            _, err = p.communicate(timeout=self.rng.uniform(0, 1.2 * self.seconds[what]) if kill and began else None)
        except subprocess.TimeoutExpired:
            p.kill()  # SIGKILL of gpusnap alone: its helpers (CRIU) live on, as after a crash
            p.communicate()
            self.kills[what] += 1
            self.recover()
            return False
        if p.returncode == 0 and began is not None:
            self.seconds[what] = 0.7 * self.seconds[what] + 0.3 * (time.monotonic() - began)
        elif p.returncode == 5:
            self.recover()
        if p.returncode != 0:
            self.failed.append(f"{what} exited {p.returncode}: {(err or '').strip()[-300:]}")
        return True

    def recover(self) -> None:
        r = self.gpusnap("recover", "--json", "--wait", "60", check=False)
        try:
            rep = json.loads(r.stdout)
        except ValueError:
            self.problems.append(f"recover printed no report (exit {r.returncode}): {r.stderr.strip()}")
            return
        if r.returncode != 0 or not rep.get("ok"):
            self.problems.append(f"recover failed: {rep}")
        self.recovered += [{"kind": o["kind"], "stage": o["stage"], "actions": o["actions"]}
                           for o in rep.get("operations", [])]

    def committed(self, name: str) -> bool:
        return any(s.get("name") == name for s in json.loads(self.gpusnap("store", "ls", "--json").stdout))


def check_tree(w: Workload, soak: Soak, where: str) -> None:
    stopped = {p: s for p, s in w.states().items() if s == "T"}
    if stopped:
        soak.problems.append(f"{where}: process(es) left stopped: {stopped}")
        raise AssertionError(soak.problems[-1])


def cycle(i: int, w: Workload, soak: Soak, last: int) -> int:
    """One dump and restore of W, each maybe killed; the counter the tree shows afterwards."""
    name = f"soak-{i}"
    soak.attempt("dump", "criu", "dump", str(w.pid), name)
    check_tree(w, soak, f"cycle {i} after the dump")
    if w.alive() and soak.committed(name):
        # committed but the kill after the commit did not happen yet: a running tree holds the pids
        soak.problems.append(f"cycle {i}: snapshot {name!r} committed and the tree still runs")
        raise AssertionError(soak.problems[-1])
    if w.alive():  # not committed: the dump was undone; the tree runs on
        rep = w.report()
        if not healthy(rep) or rep["counter"] < last:
            soak.problems.append(f"cycle {i}: the tree resumed broken: {rep}")
        return int(rep["counter"])
    if not soak.committed(name):
        soak.problems.append(f"cycle {i}: the tree is gone and {name!r} was not committed: LOST")
        raise AssertionError(soak.problems[-1])
    w.gone()
    for attempt in range(12):
        done = soak.attempt("restore", "criu", "restore", name)
        check_tree(w, soak, f"cycle {i} after restore attempt {attempt}")
        if w.alive():
            break
        if done:
            soak.retries += 1
        w.gone()
    else:
        soak.problems.append(f"cycle {i}: {name!r} did not restore in 12 attempts: LOST")
        raise AssertionError(soak.problems[-1])
    rep = w.report()
    if not healthy(rep) or rep["counter"] < last:
        soak.problems.append(f"cycle {i}: the restored tree is broken or went back: {rep} (before: {last})")
    soak.gpusnap("store", "rm", name)
    return int(rep["counter"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--kill-p", type=float, default=0.5, help="chance that each dump or restore is SIGKILLed")
    ap.add_argument("--mb", type=int, default=16, help="the tree's memory (MiB); the split moves runs of >= 4 MiB")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--store", type=Path, default=None, help="default: a fresh temporary store, removed after")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("soak: needs root (CRIU)", file=sys.stderr)
        return 4
    seed = a.seed if a.seed is not None else random.randrange(1 << 32)
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-soak-"))
    store = a.store or tmp / "store"
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "GPUSNAP_CRIU_IMAGES": "stream",
           "GPUSNAP_CRIU_SPLIT_MIN": str(4 << 20)}
    soak = Soak(store, random.Random(seed), a.kill_p, env)
    soak.gpusnap("store", "init")
    w = Workload(a.mb)
    t0 = time.monotonic()
    done, last = 0, int(w.report()["counter"])
    try:
        for i in range(a.cycles):
            last = cycle(i, w, soak, last)
            done += 1
    except AssertionError as e:
        if not soak.problems or soak.problems[-1] != str(e):
            soak.problems.append(str(e))
    finally:
        w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    actions: dict[str, int] = {}
    for r in soak.recovered:
        for act in r["actions"] or ["nothing to do"]:
            key = f"{r['kind']}@{r['stage']}: " + re.sub(r"'[^']*'|\[[^\]]*\]|/\S+|\d+(\.\d+)?", "…", act)
            actions[key] = actions.get(key, 0) + 1
    out = {"ok": not soak.problems and done == a.cycles, "cycles": done, "asked": a.cycles, "seed": seed,
           "kills": soak.kills, "recoveries": len(soak.recovered), "restore_retries": soak.retries,
           "recover_actions": dict(sorted(actions.items())), "problems": soak.problems, "failed": soak.failed,
           "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(out, indent=2))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
