"""A `criu` for zdtm's --criu-bin that sends every dump and restore through `gpusnap criu dump` and
`gpusnap criu restore` and passes every other call (check, --version, page-server, ...) to the same
CRIU. scripts/zdtm/run.py sets it up; it reads:

  GPUSNAP_ZDTM_CRIU   the real CRIU (the one gpusnap uses)
  GPUSNAP_ZDTM_STORE  the store the snapshots go into
  GPUSNAP_ZDTM_NOTES  a file: one line per CRIU option zdtm asked for that gpusnap cannot express

zdtm names an images directory per dump (-D); the snapshot is named after it, so the restore of that
directory restores that snapshot. After a dump the snapshot's images are materialized into the
directory (`gpusnap store get`) so that zdtm's own checks (the dumped page counts against the page
images, the stats) read what the store holds; CRIU's log is copied there under the name zdtm gave.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# CRIU option -> (gpusnap option or None to drop it, takes a value: True, False or "optional")
_DUMP: dict[str, tuple[str | None, bool | str]] = {
    "--tree": ("PID", True), "-t": ("PID", True),
    "--shell-job": ("--shell-job", False), "-j": ("--shell-job", False),
    "--ext-unix-sk": ("--ext-unix-sk", False), "--file-locks": ("--file-locks", False), "-l": ("--file-locks", False),
    "--link-remap": ("--link-remap", False), "--tcp-established": ("--tcp-established", False),
    "--skip-in-flight": ("--skip-in-flight", False), "--leave-running": ("--leave-running", False),
    "-R": ("--leave-running", False), "--ghost-limit": ("--ghost-limit", True),
    "--no-ghost-fiemap": ("--no-ghost-fiemap", False), "--ghost-fiemap": (None, False),
    "--force-irmap": ("--force-irmap", False), "--irmap-scan-path": ("--irmap-scan-path", True),
    "--root": ("--root", True), "-r": ("--root", True), "--external": ("--external", True),
    "--network-lock": ("--network-lock", True), "--timeout": (None, True),
    "--pidfile": (None, True),  # a dump writes none
    "--pre-dump-mode": (None, True),  # zdtm gives it to every dump; it concerns pre-dumps only
    "--manage-cgroups": ("--manage-cgroups", "optional"), "--tcp-close": ("--tcp-close", False),
}
_RESTORE: dict[str, tuple[str | None, bool | str]] = {
    "--restore-detached": (None, False), "-d": (None, False),
    "--shell-job": (None, False), "-j": (None, False),  # the dump's, recorded in the snapshot
    "--ext-unix-sk": (None, False), "--file-locks": (None, False), "-l": (None, False),
    "--link-remap": (None, False), "--tcp-established": ("--tcp-established", False),
    "--tcp-close": ("--tcp-close", False), "--root": ("--root", True), "-r": ("--root", True),
    "--external": ("--external", True), "--network-lock": ("--network-lock", True),
    "--pidfile": ("PIDFILE", True),  # written from gpusnap's report: the restored root's pid
    "--manage-cgroups": ("--manage-cgroups", "optional"),
    # dump options (zdtm gives a test's options to both; CRIU's restore does not read them)
    "--skip-in-flight": (None, False), "--force-irmap": (None, False), "--irmap-scan-path": (None, True),
    "--ghost-limit": (None, True), "--no-ghost-fiemap": (None, False), "--ghost-fiemap": (None, False),
}
_COMMON: dict[str, tuple[str | None, bool | str]] = {"--no-default-config": (None, False), "--images-dir": ("DIR", True), "-D": ("DIR", True),
           "--log-file": ("LOG", True), "-o": ("LOG", True)}


class Unexpressed(Exception):
    pass


def translate(action: str, argv: list[str]) -> tuple[str, str, str | None, list[str]]:
    """(images dir, log name, pid (dump) or pidfile (restore), gpusnap options) of a CRIU ACTION's
    ARGV; Unexpressed names the first CRIU option gpusnap has no way to say."""
    table = {**_COMMON, **(_DUMP if action == "dump" else _RESTORE)}
    out: list[str] = []
    ddir, log, pid = os.path.abspath("."), f"{action}.log", None
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        if name.startswith("-v") and not name.startswith("--") or name == "--verbosity":
            i += 1
            continue
        if name not in table:
            raise Unexpressed(f"criu {action} {a}")
        to, takes = table[name]
        if takes == "optional":  # CRIU's optional argument: only as --opt=VALUE (alone: its default, soft)
            out += [str(to), val if eq else "soft"]
            i += 1
            continue
        if takes and not eq:
            i += 1
            if i >= len(argv):
                raise Unexpressed(f"criu {action} {a} without its value")
            val = argv[i]
        if to == "DIR":
            ddir = os.path.abspath(val)
        elif to == "LOG":
            log = val
        elif to == "PID":
            pid = val
        elif to == "PIDFILE":
            pid = os.path.abspath(val)
        elif to is not None:
            out += [to, val] if takes else [to]
        i += 1
    return ddir, log, pid, out


def snapshot_name(ddir: str) -> str:
    return "zdtm-" + hashlib.sha256(os.path.realpath(ddir).encode()).hexdigest()[:24]


def gpusnap(*args: str, logs: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO, "GPUSNAP_CRIU_LOGS": logs}
    return subprocess.run([os.path.join(REPO, ".venv", "bin", "python"), "-m", "cli",
                           "--store", os.environ["GPUSNAP_ZDTM_STORE"], *args], cwd=REPO, env=env, text=True,
                          capture_output=True)


def main(argv: list[str]) -> int:
    real = os.environ["GPUSNAP_ZDTM_CRIU"]
    action = argv[0] if argv else ""
    if action not in ("dump", "restore"):
        os.execv(real, [real, *argv])
    try:
        ddir, log, pid, opts = translate(action, argv[1:])
    except Unexpressed as e:
        with open(os.environ["GPUSNAP_ZDTM_NOTES"], "a") as f:
            f.write(f"{e}\n")
        print(f"gpusnap-zdtm: cannot be expressed through gpusnap: {e}", file=sys.stderr)
        return 2
    name = snapshot_name(ddir)
    logs = tempfile.mkdtemp(prefix="gpusnap-zdtm-logs-")
    try:
        if action == "dump":
            if pid is None:
                print("gpusnap-zdtm: criu dump without --tree", file=sys.stderr)
                return 2
            r = gpusnap("criu", "dump", *opts, pid, name, logs=logs)
        else:
            r = gpusnap("criu", "restore", "--json", *opts, name, logs=logs)
            if r.returncode == 0 and pid is not None:
                with open(pid, "w") as f:
                    f.write(str(json.loads(r.stdout)["restored_pid"]))
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        kept = sorted(glob.glob(os.path.join(logs, "*.log")), key=os.path.getmtime)
        if kept:
            shutil.copyfile(kept[-1], os.path.join(ddir, log))
        if action == "dump" and r.returncode == 0:
            _materialize(name, ddir, logs)
        return r.returncode
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _materialize(name: str, ddir: str, logs: str) -> None:
    """The snapshot's images into DDIR, beside zdtm's files (its checks read them)."""
    tmp = os.path.join(ddir, ".gpusnap-images")
    g = gpusnap("store", "get", name, tmp, logs=logs)
    if g.returncode != 0:
        sys.stderr.write(g.stderr)
        raise SystemExit(g.returncode)
    for f in os.listdir(os.path.join(tmp, "images")):
        os.replace(os.path.join(tmp, "images", f), os.path.join(ddir, f))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
