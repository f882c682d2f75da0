"""CRIU's own test suite (zdtm) through gpusnap: each zdtm/static test run twice, with plain CRIU and
through `gpusnap criu dump/restore` (zdtm's --criu-bin pointing at criu-via-gpusnap, which passes every
other call to the same CRIU), and the two result columns printed. Exit 1 when a test passes with plain
CRIU and not through gpusnap.

    python3 -m scripts.zdtm.run                  # the whole static set (about 25 min on 2 cores)
    python3 -m scripts.zdtm.run --ci             # CI's subset: one or two tests per area (a few minutes)
    python3 -m scripts.zdtm.run maps09 env00     # these tests
    python3 -m scripts.zdtm.run --flavor ns ...  # zdtm's namespace flavor (--root, --external mnt[])

CRIU's source (the release gpusnap's CRIU is built from) comes from scripts/setup/install-criu.sh
--source, cached; zdtm is built in it once. Needs root. zdtm's page-count check (the pages CRIU says it
dumped against the page images' sizes) runs on both paths: after a gpusnap dump the wrapper
materializes the snapshot's images into zdtm's images directory. The hugetlb tests (maps09, maps10)
get vm.nr_hugepages=16 for the run (put back after).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRAPPER = os.path.join(REPO, "scripts", "zdtm", "criu-via-gpusnap")

# one or two tests per area, each a few seconds: memory maps (hugetlb included), files, pipes and
# sockets, TCP, signals, timers, threads and trees, a stopped tree, a failed dump (ptrace_sig must
# leave its tracer unhung), deleted files, inotify, file locks
CI_SET = ("env00", "maps00", "maps04", "maps09", "maps10", "memfd02-hugetlb", "write_read00", "fifo", "pipe00",
          "deleted_unix_sock", "sockets00", "socket-tcp", "sigaltstack", "sigpending", "posix_timers", "timers",
          "pthread00", "zombie00", "stopped", "ptrace_sig", "unlink_largefile", "ghost_holes00", "inotify00",
          "file_locks00")


@dataclass
class Outcome:
    result: str      # pass, fail, skip, unexpressed
    seconds: float
    why: str = ""


def criu_source() -> str:
    p = subprocess.run([os.path.join(REPO, "scripts", "setup", "install-criu.sh"), "--source"], text=True,
                       stdout=subprocess.PIPE)
    if p.returncode != 0 or not p.stdout.strip():
        raise SystemExit("zdtm: CRIU's source could not be fetched (scripts/setup/install-criu.sh --source)")
    return p.stdout.strip().splitlines()[-1]


def build(src: str) -> None:
    """zdtm's tests and the pycriu it imports, built once in SRC."""
    if not os.path.exists(os.path.join(src, "lib", "pycriu", "images", "images.py")):
        print("zdtm: building pycriu (once)", file=sys.stderr, flush=True)
        subprocess.run(["make", "-C", src, f"-j{os.cpu_count() or 2}", "lib"], check=True, stdout=subprocess.DEVNULL)
    if not os.path.exists(os.path.join(src, "test", "zdtm", "static", ".built")):
        print("zdtm: building zdtm (once)", file=sys.stderr, flush=True)
        # -k: a test that does not build here (a library missing) fails in both columns, the rest run
        p = subprocess.run(["make", "-k", "-C", os.path.join(src, "test", "zdtm"), f"-j{os.cpu_count() or 2}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            print("zdtm: some tests did not build:\n" + "\n".join(p.stderr.splitlines()[-5:]), file=sys.stderr)
        open(os.path.join(src, "test", "zdtm", "static", ".built"), "w").close()


_SUID = "        if not test_flag(self.__desc, 'suid'):"
_AS_ROOT = "        if not test_flag(self.__desc, 'suid') and not os.environ.get('GPUSNAP_ZDTM_AS_ROOT'):"


def patch_zdtm(src: str) -> None:
    """zdtm runs most tests as uid 18943, and CRIU reads their rlimits with prlimit(), which needs
    CAP_SYS_RESOURCE for another uid's process: where this machine withholds it (a container), every
    such test fails at `criu dump` with plain CRIU too. The one change made to zdtm: with
    $GPUSNAP_ZDTM_AS_ROOT set (run() sets it only there) the tests run as root, as zdtm's `suid` ones do."""
    path = os.path.join(src, "test", "zdtm.py")
    with open(path) as f:
        text = f.read()
    if _AS_ROOT not in text:
        if text.count(_SUID) != 1:
            raise SystemExit("zdtm: zdtm.py is not the one scripts/zdtm/run.py knows (its suid test)")
        with open(path, "w") as f:
            f.write(text.replace(_SUID, _AS_ROOT))


def lacks_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        eff = next(int(l.split()[1], 16) for l in f if l.startswith("CapEff:"))
    return not eff & (1 << 24)  # CAP_SYS_RESOURCE


def the_criu() -> str:
    p = subprocess.run([sys.executable, "-c", "from sandbox.criu.runner import find_criu; print(find_criu() or '')"],
                       cwd=REPO, text=True, capture_output=True, env={**os.environ, "PYTHONPATH": REPO})
    path = p.stdout.strip()
    if not path:
        raise SystemExit("zdtm: no CRIU >= 4 here (scripts/setup.sh)")
    return path


def run_one(src: str, test: str, criu_bin: str, flavor: str, env: dict[str, str], timeout: float) -> Outcome:
    t0 = time.monotonic()
    try:
        p = subprocess.run(["/usr/bin/python3", "zdtm.py", "run", "-t", f"zdtm/static/{test}", "-f", flavor,
                            "--criu-bin", criu_bin, "--ignore-taint", "--keep-img", "never"],
                           cwd=os.path.join(src, "test"), env=env, text=True, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome("fail", time.monotonic() - t0, f"did not finish within {timeout:g} s")
    secs = time.monotonic() - t0
    out = p.stdout + p.stderr
    if "cannot be expressed through gpusnap" in out:
        m = re.search(r"cannot be expressed through gpusnap: (.*)", out)
        return Outcome("unexpressed", secs, m.group(1) if m else "")
    if p.returncode == 0 and re.search(r"Skipping|skipped|[Nn]o test to run|not supported", out) and " PASS" not in out:
        return Outcome("skip", secs, next((l for l in out.splitlines() if re.search(r"[Ss]kip|not supported", l)), ""))
    if p.returncode == 0:
        return Outcome("pass", secs)
    ours = [l for l in out.splitlines() if l.startswith("gpusnap")]  # gpusnap's one-line error, if it said one
    lines = ours or [l for l in out.splitlines() if re.search(r"Error \(|FAIL at|fail", l)] or out.strip().splitlines()[-1:]
    return Outcome("fail", secs, (lines[0] if lines else "")[:200])


def all_static(src: str) -> list[str]:
    p = subprocess.run(["/usr/bin/python3", "zdtm.py", "list"], cwd=os.path.join(src, "test"), text=True,
                       capture_output=True, check=True)
    return [l.split("/", 2)[2] for l in p.stdout.split() if l.startswith("zdtm/static/")]


class HugePages:
    """vm.nr_hugepages at least N while it lasts (maps09/maps10 need private huge pages)."""

    def __init__(self, n: int = 16) -> None:
        self.n = n
        self.old: int | None = None

    def __enter__(self) -> "HugePages":
        with open("/proc/sys/vm/nr_hugepages") as f:
            old = self.old = int(f.read())
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(max(self.n, old)))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.old is not None:
            with open("/proc/sys/vm/nr_hugepages", "w") as f:
                f.write(str(self.old))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", help="zdtm/static test names (default: all, or --ci's)")
    ap.add_argument("--ci", action="store_true", help="the CI subset: " + " ".join(CI_SET))
    ap.add_argument("--flavor", default="h", choices=("h", "ns", "uns"), help="zdtm's flavor (default h: host)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per test and path (default 180)")
    ap.add_argument("--gpusnap-only", action="store_true", help="skip the plain CRIU column (for a quick look)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("zdtm: needs root", file=sys.stderr)
        return 4
    src = criu_source()
    build(src)
    criu = the_criu()
    tests = a.tests or (list(CI_SET) if a.ci else all_static(src))
    work = tempfile.mkdtemp(prefix="gpusnap-zdtm-")
    notes = os.path.join(work, "unexpressed")
    env = {**os.environ, "GPUSNAP_ZDTM_CRIU": criu, "GPUSNAP_ZDTM_STORE": os.path.join(work, "store"),
           "GPUSNAP_ZDTM_NOTES": notes}
    env.pop("GPUSNAP_CRIU_IMAGES", None)  # the default path, as a user gets it
    env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"  # zdtm re-runs itself through `python3`: the system's, with its modules
    patch_zdtm(src)
    if lacks_sys_resource():
        env["GPUSNAP_ZDTM_AS_ROOT"] = "1"
        print("zdtm: this machine withholds CAP_SYS_RESOURCE: the tests run as root (both columns)", flush=True)
    rows: list[tuple[str, Outcome | None, Outcome]] = []
    try:
        with HugePages():
            print(f"{'test':28} {'plain CRIU':>14} {'through gpusnap':>18}", flush=True)
            for t in tests:
                plain = None if a.gpusnap_only else run_one(src, t, criu, a.flavor, env, a.timeout)
                ours = run_one(src, t, WRAPPER, a.flavor, env, a.timeout)
                rows.append((t, plain, ours))
                cell = lambda o: "-" if o is None else f"{o.result} {o.seconds:5.1f}s"  # noqa: E731
                print(f"{t:28} {cell(plain):>14} {cell(ours):>18}" + (f"   {ours.why}" if ours.result != "pass" and ours.why else ""),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bad = [t for t, p, o in rows if p is not None and p.result == "pass" and o.result != "pass"]
    def count(col: int, r: str) -> int:
        return sum(1 for row in rows if (o := row[col]) is not None and isinstance(o, Outcome) and o.result == r)
    print(f"\n{len(rows)} tests, flavor {a.flavor}: plain CRIU {count(1, 'pass')} pass, {count(1, 'fail')} fail, "
          f"{count(1, 'skip')} skip; through gpusnap {count(2, 'pass')} pass, {count(2, 'fail')} fail, "
          f"{count(2, 'skip')} skip, {count(2, 'unexpressed')} cannot be expressed")
    if bad:
        print(f"zdtm: pass with plain CRIU, not through gpusnap: {' '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
