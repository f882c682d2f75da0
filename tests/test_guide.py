"""docs/GUIDE.md runs as written: every command line of its `sh` blocks, taken from the Markdown
itself, is run through the real CLI, each block in one shell (as a user types it: variables, exports
and background jobs carry over from line to line), in the guide's order, against a fresh store, real
files, real CRIU processes, real runc/Podman containers, real runsc sandboxes and the local Swift.
Each line's exit status and what it should have produced (a restored process answering, files equal,
a listing naming what it should) is checked by the step registered for that exact line.

A line that cannot run here is in NOT_RUN with the reason. A line in neither table fails
test_every_guide_command_is_run_or_listed, and so does an entry for a line the guide no longer has:
the guide cannot gain (or change) a command that no test runs. What the test changes in the lines,
as GUIDE says once: `/tmp/` becomes a directory of the test's own, and the names that are global to
a host (containers, sandboxes, the bucket: HOST_WIDE) get this run's suffix."""
from __future__ import annotations

import hashlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import REPO, Cli, require_root
from support.docs import GPUSNAP_FUNCTION, command_lines, fenced_blocks, shell_env

GUIDE = REPO / "docs" / "GUIDE.md"
# names the guide's lines use that are global to a host: each gets this run's suffix
HOST_WIDE = ("counter", "app", "app2", "gpusnap-demo")
SUFFIX = f"-g{os.getpid() % 100000}"


# ---------------------------------------------------------------------------------------- the shell
@dataclass
class Ran:
    """What one line did: its exit status, its stdout and stderr, its wall time."""

    line: str
    rc: int
    out: str
    err: str
    seconds: float

    def __str__(self) -> str:
        return f"`{self.line}` exited {self.rc}\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-3000:]}"


class Shell:
    """One bash for a block: each line runs in it as typed (in a `{ }` group, so assignments, exports
    and `cd` persist), with its stdout and stderr in files of its own and stdin from /dev/null; the
    shell has `pipefail` on, so every command of a pipeline must succeed. The shell leads its own
    process group, ended as a whole when the block is done or a line overruns."""

    def __init__(self, env: dict[str, str], work: Path) -> None:
        self.work = work
        self.n = 0
        self.proc = subprocess.Popen(["bash", "--norc", "--noprofile"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        self._send("set -o pipefail\n" + GPUSNAP_FUNCTION)

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def run(self, line: str, timeout: float) -> Ran:
        self.n += 1
        out, err = self.work / f"{self.n}.out", self.work / f"{self.n}.err"
        t0 = time.monotonic()
        self._send(f"{{ {line}\n}} >'{out}' 2>'{err}' </dev/null\necho \"__rc__ $?\"\n")
        assert self.proc.stdout is not None
        got = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not re.search(rb"__rc__ (\d+)\n", got):
                left = t0 + timeout - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.close()
                    raise AssertionError(f"`{line}` did not finish in {timeout:g} s")
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"the shell ended at `{line}`: {got.decode(errors='replace')}")
                got += chunk
        m = re.search(rb"__rc__ (\d+)\n", got)
        assert m is not None
        extra = got[:m.start()].decode(errors="replace")   # what bash itself said (e.g. a syntax error)
        return Ran(line, int(m.group(1)), out.read_text(errors="replace"), extra + err.read_text(errors="replace"),
                   time.monotonic() - t0)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


# ------------------------------------------------------------------------------- what steps share
@dataclass
class Ctx:
    """A block's run: TMP is what `/tmp/` became, STORE the default store, SEEN what one step keeps
    for a later one, CLEANUP what the steps made that outlives the block unless removed."""

    tmp: Path
    cleanup: ExitStack
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def store(self) -> Path:
        return self.tmp / "store"

    def path(self, guide_path: str) -> Path:
        """Where GUIDE's /tmp/... path is in this run."""
        assert guide_path.startswith("/tmp/")
        return self.tmp / guide_path[len("/tmp/"):]

    def cli(self, *args: str, store: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The test's own gpusnap call (to prepare or to check), against STORE (default: the block's)."""
        return Cli(store or self.store).run(*args, check=check)

    def snapshots(self, store: Path | None = None) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in json.loads(self.cli("store", "ls", "--json", store=store).stdout)}


def unique(name: str) -> str:
    return name + SUFFIX


def localize(line: str, tmp: Path) -> str:
    """LINE as this run types it: /tmp/ moved into TMP, host-wide names made unique."""
    line = line.replace("/tmp/", f"{tmp}/")
    for name in HOST_WIDE:
        line = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w])", unique(name), line)
    return line


Check = Callable[[Ctx, Ran], None]
Before = Callable[[Ctx], None]


@dataclass(frozen=True)
class Step:
    check: Check
    before: Before | None
    timeout: float


STEPS: dict[str, Step] = {}


def runs(line: str, before: Before | None = None, timeout: float = 120) -> Callable[[Check], Check]:
    """Register CHECK for GUIDE's command LINE (as written there, without its comment); BEFORE
    prepares what a user would already have (their data, a process), TIMEOUT bounds the line."""
    def register(check: Check) -> Check:
        assert line not in STEPS, line
        STEPS[line] = Step(check, before, timeout)
        return check
    return register


def ok(r: Ran, *must: str) -> None:
    """R exited 0 and its stdout+stderr says each of MUST."""
    assert r.rc == 0, str(r)
    for m in must:
        assert m in r.out + r.err, f"{m!r} not said\n{r}"


def tree_digest(top: Path) -> dict[str, str]:
    """Every regular file under TOP, by relative path: its SHA-256."""
    return {str(p.relative_to(top)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(top.rglob("*")) if p.is_file() and not p.is_symlink()}


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:g} s"
        time.sleep(0.05)


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ------------------------------------------------------------------ lines that cannot run here
_NO_GPU = ("needs an NVIDIA GPU whose driver has the custom-storage API (CUDA 13.4, R615+): the pool daemon "
           "pins its memory and swaps through the CUDA driver; CI has no GPU. The daemon, its socket protocol "
           "and these commands run in CI against the driver stand-in: tests/test_pool_daemon.py")
_NO_DAEMON = ("talks to the pool daemon, which needs that GPU (`gpusnap pool serve` above); run in CI against "
              "the driver stand-in: tests/test_pool_daemon.py")
_NO_VLLM = ("needs a vLLM server with sleep mode, which the CPU machine does not have; the same hooks run "
            "with real CRIU in tests/test_hooks.py and, against a transformers server, in tests/test_workload_helper.py")
NOT_RUN: dict[str, str] = {
    "gpusnap pool serve --size 64G &": _NO_GPU,
    'gpusnap gpu checkpoint "$(cat /tmp/llama.pid)" llama --tier memory': _NO_GPU + " (and a CUDA process)",
    "gpusnap pool ls": _NO_DAEMON,
    'gpusnap gpu restore llama "$(cat /tmp/llama.pid)" --tier memory': _NO_GPU + " (and a CUDA process)",
    "gpusnap pool usage": _NO_DAEMON,
    "gpusnap pool rm llama": _NO_DAEMON,
    "gpusnap pool stop": _NO_DAEMON,
    # the hooks section: its steps are tested with real CRIU in tests/test_hooks.py and
    # tests/test_workload_helper.py
    "gpusnap criu dump \"$(cat /tmp/vllm.pid)\" llm --prepare 'http://127.0.0.1:8000/sleep?level=1' "
    "--resume http://127.0.0.1:8000/wake_up": _NO_VLLM,
    "gpusnap criu restore llm": _NO_VLLM,
    "gpusnap gpu checkpoint \"$(cat /tmp/vllm.pid)\" llm-gpu --prepare 'http://127.0.0.1:8000/sleep?level=1' "
    "--resume http://127.0.0.1:8000/wake_up": _NO_VLLM + " (and a GPU)",
    'gpusnap gpu restore llm-gpu "$(cat /tmp/vllm.pid)"': _NO_VLLM + " (and a GPU)",
}


# ------------------------------------------------------------------------ Keeping the store whole
@runs("gpusnap store init")
def store_init(c: Ctx, r: Ran) -> None:
    ok(r, "empty gpusnap store created")
    assert (c.store / "gpusnap-store.json").is_file() and c.snapshots() == {}


def make_data(c: Ctx) -> None:
    d = c.path("/tmp/data")
    (d / "models").mkdir(parents=True)
    (d / "models" / "weights.bin").write_bytes(os.urandom(12 << 20))
    (d / "models" / "config.json").write_text('{"layers": 32}\n')


@runs("gpusnap store put data-1 /tmp/data", before=make_data)
def store_put_data(c: Ctx, r: Ran) -> None:
    ok(r, "data-1:")
    assert c.snapshots()["data-1"]["kind"] == "files"


def damage_a_chunk(c: Ctx) -> None:
    """A bad disk: one byte of the payload of the largest stored chunk flips."""
    from support.entries import chunk_entries
    victim = max(chunk_entries(c.store), key=lambda e: e.length)
    victim.flip_payload(0.5)
    c.seen["damaged"] = victim.cid


@runs("gpusnap store verify", before=damage_a_chunk)
def store_verify_finds(c: Ctx, r: Ran) -> None:
    assert r.rc == 3 and "DAMAGED data-1: data/models/weights.bin" in r.out, str(r)
    assert [p.name for p in (c.store / "quarantine").iterdir()] != []
    assert c.snapshots()["data-1"]["damaged_chunks"] == 1   # `store ls` marks it now


@runs("gpusnap store verify --read-data data-1")
def store_verify_read_data(c: Ctx, r: Ran) -> None:
    assert r.rc == 3 and "DAMAGED data-1" in r.out and "quarantine" in r.out, str(r)


@runs("gpusnap store repair --from /tmp/data")
def store_repair(c: Ctx, r: Ran) -> None:
    ok(r, "every snapshot is whole", f"REPAIRED {c.seen['damaged'][:16]}")
    assert c.snapshots()["data-1"]["damaged_chunks"] == 0
    c.cli("store", "verify", "--read-data")
    c.cli("store", "get", "data-1", str(c.tmp / "check"))
    assert tree_digest(c.tmp / "check" / "data") == tree_digest(c.path("/tmp/data"))


@runs("gpusnap store rm data-1")
def store_rm(c: Ctx, r: Ran) -> None:
    ok(r, "removed snapshot data-1")
    assert c.snapshots() == {}


@runs("gpusnap store gc")
def store_gc(c: Ctx, r: Ran) -> None:
    from support.entries import chunk_ids
    ok(r, "removed")
    assert re.search(r"[1-9]\d* unreferenced chunks removed", r.out), str(r)
    assert chunk_ids(c.store) == set()   # nothing named them any more


def make_old_store(c: Ctx) -> None:
    """What a version-2 gpusnap left: a snapshot whose chunks are one file each."""
    from support.entries import chunk_entries, to_chunk_files
    c.cli("store", "put", "data-old", str(c.path("/tmp/data")))
    to_chunk_files(c.store, 2)
    c.seen["chunk_files"] = len(chunk_entries(c.store))
    assert c.seen["chunk_files"] > 1


@runs("gpusnap store migrate", before=make_old_store)
def store_migrate(c: Ctx, r: Ran) -> None:
    from support.entries import chunk_entries
    ok(r, f"moved {c.seen['chunk_files']} chunk files")
    ents = chunk_entries(c.store)
    assert len(ents) == c.seen["chunk_files"] and all(e.in_pack for e in ents)
    c.cli("store", "get", "data-old", str(c.tmp / "migrated"))
    assert tree_digest(c.tmp / "migrated" / "data") == tree_digest(c.path("/tmp/data"))


# ---------------------------------------------------------------------------------------- Archives
@runs("mkdir -p /tmp/models/llama && head -c 8388608 /dev/urandom > /tmp/models/llama/weights.bin")
def make_models(c: Ctx, r: Ran) -> None:
    ok(r)
    assert c.path("/tmp/models/llama/weights.bin").stat().st_size == 8 << 20


@runs("""echo '{"layers": 32}' > /tmp/models/llama/config.json""")
def make_config(c: Ctx, r: Ran) -> None:
    ok(r)
    assert c.path("/tmp/models/llama/config.json").read_text() == '{"layers": 32}\n'


@runs("""echo '{"layers": 40}' > /tmp/models/llama/config.json""")
def next_night(c: Ctx, r: Ran) -> None:
    """The model's configuration changed since last night; its weights did not."""
    ok(r)
    assert c.path("/tmp/models/llama/config.json").read_text() == '{"layers": 40}\n'


@runs("gpusnap store put llama-2026-11-29 /tmp/models/llama --tag model=llama --tag nightly --replace")
def put_first_night(c: Ctx, r: Ran) -> None:
    ok(r, "llama-2026-11-29:")
    assert sorted(c.snapshots()["llama-2026-11-29"]["tags"]) == ["model=llama", "nightly"]


@runs("gpusnap store put llama-2026-11-30 /tmp/models/llama --tag model=llama --tag nightly --replace")
def put_second_night(c: Ctx, r: Ran) -> None:
    ok(r, "llama-2026-11-30:")
    written = re.search(r"([\d.]+) (B|kB|MB|GB) written", r.out)
    assert written and (written.group(2) in ("B", "kB")), f"the unchanged weights were stored again\n{r}"


@runs("gpusnap store ls --tag nightly --since 7d")
def ls_tag_since(c: Ctx, r: Ran) -> None:
    ok(r)
    names = [ln.split()[0] for ln in r.out.splitlines()[1:]]
    assert names == ["llama-2026-11-29", "llama-2026-11-30"], str(r)


@runs("gpusnap store stats")
def stats(c: Ctx, r: Ran) -> None:
    ok(r, "2 snapshots", "deduplicated (2.00x)")


@runs("gpusnap store ls llama-2026-11-30 llama/")
def ls_files(c: Ctx, r: Ran) -> None:
    ok(r)
    rows = {ln.split()[-1]: ln.split()[-2] for ln in r.out.splitlines()[1:]}
    assert rows.get("llama/weights.bin") == str(8 << 20) and rows.get("llama/config.json") == "15", str(r)


@runs("gpusnap store diff llama-2026-11-29 llama-2026-11-30")
def diff(c: Ctx, r: Ran) -> None:
    ok(r, "M llama/config.json", "1 stream(s) differ")
    assert "weights.bin" not in r.out


@runs("rm -rf /tmp/part && gpusnap store get llama-2026-11-30 /tmp/part --include 'llama/config*'")
def get_part(c: Ctx, r: Ran) -> None:
    ok(r, "verified")
    assert tree_digest(c.path("/tmp/part")) == {"llama/config.json": hashlib.sha256(b'{"layers": 40}\n').hexdigest()}


@runs("gpusnap store cat llama-2026-11-30 llama/config.json | python3 -m json.tool")
def cat_json(c: Ctx, r: Ran) -> None:
    ok(r)
    assert json.loads(r.out) == {"layers": 40}


@runs("gpusnap store export llama-2026-11-30 - | gpusnap --store /tmp/other store import - --replace")
def export_import(c: Ctx, r: Ran) -> None:
    ok(r, "imported llama-2026-11-30")
    other = c.path("/tmp/other")
    assert list(c.snapshots(store=other)) == ["llama-2026-11-30"]
    c.cli("store", "get", "llama-2026-11-30", str(c.tmp / "from-other"), store=other)
    assert tree_digest(c.tmp / "from-other" / "llama") == tree_digest(c.path("/tmp/models/llama"))


@runs("gpusnap store tag llama-2026-11-30 --add release --remove nightly")
def tag(c: Ctx, r: Ran) -> None:
    ok(r, "llama-2026-11-30: [model=llama,release]")
    assert sorted(c.snapshots()["llama-2026-11-30"]["tags"]) == ["model=llama", "release"]


def three_more_nights(c: Ctx) -> None:
    """Three more nightly snapshots, so that the retention policy has one to let go."""
    for n in (1, 2, 3):
        c.cli("store", "put", f"llama-nightly-{n}", str(c.path("/tmp/models/llama")), "--tag", "model=llama",
              "--tag", "nightly")


@runs("gpusnap store forget --tag nightly --keep-last 3 --keep-daily 7 --keep-weekly 4 --dry-run",
      before=three_more_nights)
def forget_dry_run(c: Ctx, r: Ran) -> None:
    ok(r, "would remove llama-2026-11-29")
    kept = [ln.split()[1] for ln in r.out.splitlines() if ln.startswith("keep ")]
    assert sorted(kept) == [f"llama-nightly-{n}" for n in (1, 2, 3)], str(r)
    assert "llama-2026-11-29" in c.snapshots()   # a dry run removes nothing


@runs("gpusnap store forget --tag nightly --keep-last 3 --keep-daily 7 --keep-weekly 4 --prune")
def forget_prune(c: Ctx, r: Ran) -> None:
    ok(r, "remove llama-2026-11-29", "prune: removed")   # its one chunk of its own stays in a pack that is
    # mostly alive (gc repacks a pack once less than half of it is needed)
    assert sorted(c.snapshots()) == ["llama-2026-11-30", "llama-nightly-1", "llama-nightly-2", "llama-nightly-3"]


@runs("gpusnap store lock status")
def lock_status(c: Ctx, r: Ran) -> None:
    ok(r, "no locks held")


@runs("gpusnap store verify --read-data-subset 10%")
def verify_subset_percent(c: Ctx, r: Ran) -> None:
    ok(r, "4 snapshot(s)", "checked: OK")


@runs("gpusnap store verify --read-data-subset 2/5")
def verify_subset_group(c: Ctx, r: Ran) -> None:
    ok(r, "checked: OK", "not read this run")


@runs("gpusnap store verify --max-duration 10m")
def verify_max_duration(c: Ctx, r: Ran) -> None:
    ok(r, "checked: OK")
    assert "not read" not in r.out + r.err, str(r)   # 10 minutes read everything here


# ------------------------------------------------------------------------ Containers: runc, Podman
HOOK_RECORD = Path("/usr/local/lib/gpusnap/hook-install.json")
HOOK_LOG = Path("/var/log/gpusnap/criu-hook.log")


def real_machine_for_the_hook(c: Ctx) -> None:
    """The block installs the hook into the real /etc/criu and /usr/local: refuse where one is
    installed already (its uninstall would remove that), and put /etc/criu back byte for byte and
    uninstall whatever the block left, even if it fails."""
    from support.containers import real_etc_criu
    from support.containers import need, runtime_env
    need("podman", "runc", "/bin/busybox")
    runtime_env()   # skips without CRIU >= 4; the shell has the project's CRIU first on PATH already
    if HOOK_RECORD.exists():
        pytest.fail(f"a gpusnap hook is installed here already ({HOOK_RECORD}); the guide's block would remove it")
    etc = c.cleanup.enter_context(real_etc_criu())
    from support.containers import snapshot_dir
    c.seen["etc_before"] = snapshot_dir(etc)
    c.cleanup.callback(lambda: HOOK_RECORD.exists() and c.cli("hook", "uninstall", check=False))
    name = unique("counter")
    c.cleanup.callback(lambda: subprocess.run(["podman", "--runtime", "runc", "rm", "-f", name], capture_output=True))


@runs("gpusnap hook install", before=real_machine_for_the_hook, timeout=300)
def hook_install(c: Ctx, r: Ran) -> None:
    ok(r)
    assert "action-script /usr/local/lib/gpusnap/gpusnap-criu-hook" in Path("/etc/criu/runc.conf").read_text()
    assert os.access("/usr/local/lib/gpusnap/gpusnap-criu-hook", os.X_OK) and HOOK_RECORD.is_file()


@runs("gpusnap hook status")
def hook_status(c: Ctx, r: Ran) -> None:
    ok(r, "reads /etc/criu/runc.conf", "/usr/local/lib/gpusnap/gpusnap-criu-hook")
    assert "not installed" not in r.out, str(r)


@runs("mkdir -p /tmp/bb/bin /tmp/bb/tmp && cp /bin/busybox /tmp/bb/bin/ && tar -C /tmp/bb -c . | podman import - "
      "localhost/bb")
def podman_import_image(c: Ctx, r: Ran) -> None:
    ok(r)


@runs("podman --runtime runc run -d --name counter --network none --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 "
      "localhost/bb /bin/busybox sh -c 'i=0; while :; do i=$((i+1)); echo $i; sleep 1; done'")
def podman_run(c: Ctx, r: Ran) -> None:
    ok(r)
    assert re.fullmatch(r"[0-9a-f]{64}\n", r.out), str(r)


@runs("sleep 10; podman logs --tail 1 counter")
def podman_counts(c: Ctx, r: Ran) -> None:
    ok(r)
    c.seen["count"] = int(r.out.split()[-1])
    assert c.seen["count"] >= 5, str(r)
    c.seen["hook_log"] = HOOK_LOG.stat().st_size if HOOK_LOG.exists() else 0


@runs("podman --runtime runc container checkpoint --export /tmp/counter.tar.zst counter")
def podman_checkpoint(c: Ctx, r: Ran) -> None:
    ok(r)
    assert c.path(f"/tmp/{unique('counter')}.tar.zst").stat().st_size > 0
    with open(HOOK_LOG, "rb") as f:   # the hook install wired in ran at the checkpoint
        f.seek(c.seen["hook_log"])
        assert b" pre-dump: " in f.read(), "the installed hook did not run at pre-dump"


@runs("gpusnap import podman /tmp/counter.tar.zst counter-1")
def import_podman(c: Ctx, r: Ran) -> None:
    ok(r)
    assert c.snapshots()[unique("counter") + "-1"]["kind"] == "podman-checkpoint"


@runs("rm /tmp/counter.tar.zst && podman rm counter")
def podman_rm(c: Ctx, r: Ran) -> None:
    ok(r)
    assert subprocess.run(["podman", "container", "exists", unique("counter")]).returncode != 0


@runs("gpusnap export counter-1 /tmp/counter.tar")
def export_archive(c: Ctx, r: Ran) -> None:
    ok(r)
    with tarfile.open(c.path(f"/tmp/{unique('counter')}.tar")) as t:
        assert any(n.startswith("checkpoint/pages-") for n in t.getnames())


@runs("podman --runtime runc container restore --import /tmp/counter.tar")
def podman_restore(c: Ctx, r: Ran) -> None:
    ok(r)


@runs("sleep 2; podman logs --tail 1 counter")
def podman_counts_on(c: Ctx, r: Ran) -> None:
    ok(r)
    assert int(r.out.split()[-1]) > c.seen["count"], f"counted from 1 again, not on from {c.seen['count']}\n{r}"


@runs("gpusnap hook uninstall")
def hook_uninstall(c: Ctx, r: Ran) -> None:
    from support.containers import snapshot_dir
    ok(r)
    assert snapshot_dir(Path("/etc/criu")) == c.seen["etc_before"], "the configs are not back as they were"
    assert not HOOK_RECORD.exists() and not os.path.exists("/usr/local/lib/gpusnap/gpusnap-criu-hook")


# ---------------------------------------------------------------------------------- gVisor (runsc)
def runsc_root(c: Ctx) -> None:
    from support.runsc import require_runsc
    require_runsc()
    root = c.path("/tmp/runsc")

    def remove() -> None:
        from sandbox.runsc.records import forget_root
        for cid in (unique("app"), unique("app2")):
            subprocess.run(["runsc", f"--root={root}", "delete", "-force", cid], capture_output=True)
        forget_root(str(root))
    c.cleanup.callback(remove)


@runs('R="--runsc-arg=--root=/tmp/runsc --runsc-arg=--platform=ptrace --runsc-arg=--network=none"', before=runsc_root)
def runsc_args(c: Ctx, r: Ran) -> None:
    ok(r)


def make_bundle(c: Ctx) -> None:
    """An OCI bundle of a counter that prints `N HASH` ten times a second."""
    from sandbox.runsc.oci_bundle import build_bundle
    from support.runsc import COUNTER, PY
    build_bundle(str(c.path("/tmp/bundle")), [PY, "-c", COUNTER])


def counts(path: Path) -> list[int]:
    return [int(ln.split()[0]) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


@runs("gpusnap runsc run app --bundle /tmp/bundle $R --output /tmp/app.log", before=make_bundle, timeout=180)
def runsc_run(c: Ctx, r: Ran) -> None:
    ok(r)
    log = c.path(f"/tmp/{unique('app')}.log")
    wait_for(lambda: len(counts(log)) >= 10, "the sandbox counts")


@runs("gpusnap runsc checkpoint app snap1 $R", timeout=180)
def runsc_checkpoint(c: Ctx, r: Ran) -> None:
    ok(r, "snap1:")
    assert c.snapshots()["snap1"]["kind"] == "runsc"
    c.seen["last"] = counts(c.path(f"/tmp/{unique('app')}.log"))[-1]
    assert sandboxes(c) == [unique("app")]   # stopped, not gone


@runs("gpusnap runsc restore snap1 app2 --bundle /tmp/bundle", timeout=180)
def runsc_restore(c: Ctx, r: Ran) -> None:
    ok(r)
    out = c.store / "logs" / f"runsc-{unique('app2')}.out"
    assert str(out) in r.out + r.err, f"restore does not say where the output goes\n{r}"
    wait_for(lambda: len(counts(out)) >= 5, "the restored sandbox counts")
    first = counts(out)[0]
    assert first > c.seen["last"] - 5 and first > 5, f"counted from {first}, not on from {c.seen['last']}"


def sandboxes(c: Ctx) -> list[str]:
    """The ids runsc knows in the block's root."""
    p = subprocess.run(["runsc", f"--root={c.path('/tmp/runsc')}", "list", "-quiet"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


@runs("gpusnap runsc delete app $R")
def runsc_delete_checkpointed(c: Ctx, r: Ran) -> None:
    ok(r)
    assert sandboxes(c) == [unique("app2")]


@runs("gpusnap runsc delete app2 $R")
def runsc_delete_restored(c: Ctx, r: Ran) -> None:
    ok(r)
    assert sandboxes(c) == []


# --------------------------------------------------------------------- What survives a crash
def a_dump_killed_before_its_commit(c: Ctx) -> None:
    """A `criu dump` killed -9 once CRIU is done and before the commit: the tree is left stopped."""
    from support.crash import Paused
    from support.criu import Tree, require_criu
    require_criu()
    tree = Tree(mb=8)
    c.cleanup.callback(tree.close)
    dump = Paused(c.store, ["criu", "dump", str(tree.pid), "victim"], "before-commit", c.tmp)
    dump.stop(signal.SIGKILL)
    assert proc_state(tree.pid) == "T", proc_state(tree.pid)
    c.seen["tree"] = tree


@runs("gpusnap recover", before=a_dump_killed_before_its_commit)
def recover(c: Ctx, r: Ran) -> None:
    from support.criu import healthy
    ok(r)
    tree = c.seen["tree"]
    assert proc_state(tree.pid) in ("S", "R"), proc_state(tree.pid)
    assert healthy(tree.report()), "the resumed tree does not answer as it should"
    assert "victim" not in c.snapshots()
    assert [p.name for p in (c.store / "journal").iterdir() if p.name.endswith(".json")] == []


# --------------------------------------------------------------------------------------- Remotes
def swift(c: Ctx) -> None:
    require_root("this block of the guide runs as root (CRIU, containers, sandboxes); CI runs as root")
    from support.criu import require_criu
    from support.swift import drop_bucket, swift_start
    require_criu()
    endpoint = swift_start()
    c.cleanup.callback(drop_bucket, endpoint, unique("gpusnap-demo"))

    def kill_sleeper() -> None:
        pid_file = c.path("/tmp/sleeper.pid")
        if pid_file.exists():
            subprocess.run(["kill", "-9", pid_file.read_text().strip()], capture_output=True)
    c.cleanup.callback(kill_sleeper)


@runs("scripts/setup/swift-setup.sh start", before=swift, timeout=600)
def swift_started(c: Ctx, r: Ran) -> None:
    ok(r, "http://127.0.0.1:18480")


@runs("export GPUSNAP_S3_ACCESS_KEY_ID=test:tester GPUSNAP_S3_SECRET_ACCESS_KEY=testing")
def credentials(c: Ctx, r: Ran) -> None:
    ok(r)


@runs("gpusnap --store /tmp/nodeA remote add fleet s3://gpusnap-demo/fleet --endpoint http://127.0.0.1:18480")
def remote_add_a(c: Ctx, r: Ran) -> None:
    ok(r)
    assert "fleet" in c.cli("remote", "list", store=c.path("/tmp/nodeA")).stdout


@runs("(setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /tmp/sleeper.pid)")
def sleeper(c: Ctx, r: Ran) -> None:
    ok(r)
    pid = c.seen["pid"] = int(c.path("/tmp/sleeper.pid").read_text())
    wait_for(lambda: sleeps(pid), "the sleeper runs")


def sleeps(pid: int) -> bool:
    """PID is a live `sleep 1000`."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x001000\x00" and proc_state(pid) not in ("Z", "T")
    except OSError:
        return False


@runs('gpusnap --store /tmp/nodeA criu dump "$(cat /tmp/sleeper.pid)" sleeper', timeout=180)
def dump_sleeper(c: Ctx, r: Ran) -> None:
    ok(r)
    assert c.snapshots(store=c.path("/tmp/nodeA"))["sleeper"]["kind"] == "criu"
    wait_for(lambda: proc_state(c.seen["pid"]) == "gone", "the dumped process is killed and reaped")


@runs("gpusnap --store /tmp/nodeA push sleeper fleet", timeout=180)
def push(c: Ctx, r: Ran) -> None:
    ok(r, "sleeper")


@runs("gpusnap --store /tmp/nodeB remote add fleet s3://gpusnap-demo/fleet --endpoint http://127.0.0.1:18480")
def remote_add_b(c: Ctx, r: Ran) -> None:
    ok(r)


@runs("gpusnap --store /tmp/nodeB remote ls fleet")
def remote_ls(c: Ctx, r: Ran) -> None:
    ok(r)
    assert [ln.split()[0] for ln in r.out.splitlines()[1:]] == ["sleeper"], str(r)


@runs("gpusnap --store /tmp/nodeB criu restore sleeper --from fleet", timeout=180)
def restore_from_remote(c: Ctx, r: Ran) -> None:
    ok(r)
    pid = c.seen["pid"]
    assert sleeps(pid), proc_state(pid)
    assert "sleeper" in c.snapshots(store=c.path("/tmp/nodeB"))   # committed locally once all of it arrived


@runs('ps -o pid,cmd -p "$(cat /tmp/sleeper.pid)"')
def ps_sleeper(c: Ctx, r: Ran) -> None:
    ok(r)
    assert r.out.split()[2:] == [str(c.seen["pid"]), "sleep", "1000"], str(r)


# ---------------------------------------------------------------------------------------- the tests
def _guide_blocks() -> list[tuple[str, list[str]]]:
    """(heading, command lines) of every block of GUIDE that is not a synopsis."""
    return [(b.heading, command_lines(b.body)) for b in fenced_blocks(GUIDE.read_text()) if b.lang != "text"]


def test_every_guide_command_is_run_or_listed() -> None:
    """Every command line of GUIDE's `sh` blocks has a step here or a reason it cannot run; every
    step and reason is for a line GUIDE has; `text` blocks hold only synopses (of `gpusnap`, which
    test_docs.py checks against the commands and options that exist)."""
    blocks = fenced_blocks(GUIDE.read_text())
    assert {b.lang for b in blocks} <= {"sh", "text"}, \
        f"GUIDE's fenced blocks are `sh` (run here) or `text` (synopses): {sorted({b.lang for b in blocks})}"
    for b in blocks:
        if b.lang == "text":
            bad = [ln for ln in command_lines(b.body) if not ln.startswith("gpusnap ")]
            assert not bad, f"GUIDE line {b.line}: a `text` block holds only `gpusnap` synopses: {bad}"
    shown = [line for _, lines in _guide_blocks() for line in lines]
    assert len(shown) > 50
    neither = [line for line in shown if line not in STEPS and line not in NOT_RUN]
    assert not neither, f"GUIDE commands that no step runs and NOT_RUN does not list: {neither}"
    stale = [line for line in (*STEPS, *NOT_RUN) if line not in shown]
    assert not stale, f"steps for lines GUIDE no longer has: {stale}"
    assert not set(STEPS) & set(NOT_RUN)


def _runnable() -> list[Any]:
    out = []
    for heading, lines in _guide_blocks():
        if any(line in STEPS for line in lines):
            out.append(pytest.param(heading, lines, id=re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")))
    return out


@pytest.mark.root
@pytest.mark.parametrize("heading, lines", _runnable())
def test_guide_block_runs_as_written(heading: str, lines: list[str]) -> None:
    """One `sh` block of GUIDE, line by line in one shell, each line checked by its step; the lines
    NOT_RUN lists are not typed."""
    tmp = Path(tempfile.mkdtemp(prefix="gsg", dir="/tmp"))   # short: runsc's socket names come from its root
    t0 = time.monotonic()
    times = []
    try:
        with ExitStack() as cleanup:
            c = Ctx(tmp, cleanup)
            (tmp / ".shell").mkdir()
            shell = Shell(shell_env(c.store), tmp / ".shell")
            cleanup.callback(shell.close)
            for line in lines:
                if line in NOT_RUN:
                    continue
                step = STEPS[line]
                if step.before:
                    step.before(c)
                r = shell.run(localize(line, tmp), step.timeout)
                step.check(c, r)
                times.append(f"{r.seconds:5.1f} s  {line[:90]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{heading}: {time.monotonic() - t0:.1f} s\n" + "\n".join(times))


def test_guide_gpu_line_without_a_gpu_exits_4(tmp_path: Path) -> None:
    """Where NOT_RUN's reason holds (no NVIDIA GPU or driver here), GUIDE's first GPU line, typed as
    written but in the foreground, says so in one line and exits 4 (this machine lacks something),
    not 1: what a user without a GPU meets."""
    from conftest import have_gpu
    line = "gpusnap pool serve --size 64G &"
    assert line in NOT_RUN
    if have_gpu():
        pytest.skip("this machine has a GPU: the GPU tests (scripts/gpu-tests.sh) run the memory tier")
    (tmp_path / "sh").mkdir()
    shell = Shell(shell_env(tmp_path / "store"), tmp_path / "sh")
    try:
        r = shell.run(line.removesuffix(" &") + f" --socket {tmp_path}/pool.sock", 60)
    finally:
        shell.close()
    assert r.rc == 4 and len(r.err.splitlines()) == 1 and "gpusnap: " in r.err, str(r)
    assert not (tmp_path / "pool.sock").exists()
