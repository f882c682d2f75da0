"""Every open() in storage/ and sandbox/ of a file a writer could plant something at is non-blocking.

A FIFO (or a device) planted where gpusnap opens a store, journal or key file must never make it
block: such an open carries O_NONBLOCK (or O_DIRECTORY, O_PATH, or O_CREAT|O_EXCL: nothing planted
can answer it), and the code checks what it opened through the fd before reading. This test walks
every os.open() and builtin open() call in storage/ and sandbox/ (AST), resolves the names its flags
are built from (module or function assignments), and fails on any call that is neither of that kind,
nor of a kernel file (/proc, /sys), nor in ALLOWED below with the reason it cannot be planted.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAFE_FLAGS = ("O_NONBLOCK", "O_DIRECTORY", "O_PATH", "O_EXCL")

# (file, a fragment of the call's source) -> why no writer of a store can plant a FIFO there
ALLOWED: dict[tuple[str, str], str] = {
    ("sandbox/containers/checkpoint_archive.py", "os.open(path"): "a checkpoint archive podman made in the operator's path",
    ("sandbox/containers/hook_bundle.py", "open(a"): "the installed hook's files, compared with the one being installed",
    ("sandbox/containers/hook_bundle.py", "open(b"): "the installed hook's files, compared with the one being installed",
    ("sandbox/criu/filehints.py", "os.open(f'/proc/self/fd/"): "re-opens an fd it holds and already checked",
    ("sandbox/criu/restore.py", "open(os.path.join(images_dir, 'pstree.img'"): "CRIU's image in the operation's "
        "own staging directory (0700, made by gpusnap, named after the operation)",
    ("sandbox/criu/restore.py", "open(pidfile)"): "CRIU's pid file in the operation's own 0700 staging directory",
    ("sandbox/criu/snapshot.py", "open(run.pidfile)"): "CRIU's pid file in the operation's own 0700 staging directory",
    ("sandbox/criu/netlock.py", "open(binary, 'rb')"): "the CRIU binary gpusnap runs (the operator's, found as "
        "the runner finds it), read to see whether it links libnftables",
    ("sandbox/criu/runner.py", "open(log_path"): "CRIU's log in the operation's own 0700 staging directory",
    ("sandbox/host/hugepages.py", "open(tmp, 'w')"): "THP record in the run directory (root-only tmpfs)",
    ("sandbox/host/hugepages.py", "open(path)"): "sysfs THP setting (/sys/kernel/mm/transparent_hugepage)",
    ("sandbox/host/hugepages.py", "open(path, 'w')"): "sysfs THP setting (/sys/kernel/mm/transparent_hugepage)",
    ("sandbox/host/hugepages.py", "open(os.path.join(devices"): "sysfs (/sys/bus/...)",
    ("sandbox/host/hugepages.py", "open(order_path)"): "sysfs (/sys/kernel/mm/...)",
    ("sandbox/host/hugepages.py", "open(p)"): "THP records in the run directory (root-only tmpfs)",
    ("sandbox/host/hugepages.py", "open(rec.path, 'w')"): "sysfs THP setting a record names, checked against the known list",
    ("sandbox/gpu/processes.py", "open(os.path.join(dirpath, 'cgroup.procs'"): "cgroupfs (kernel files)",
    ("sandbox/ops/journal.py", "open(script, 'w')"): "test hook (GPUSNAP_TEST_PAUSE only): the staging directory",
    ("sandbox/runsc/oci_bundle.py", "open(tmp, 'w')"): "a new file in the bundle gpusnap makes",
    ("sandbox/runsc/oci_bundle.py", "open(os.path.join(bundle, 'config.json'"): "the operator's OCI bundle",
    ("sandbox/runsc/records.py", "open(tmp, 'w')"): "runsc records under the runsc root (root-only)",
    ("sandbox/runsc/records.py", "open(os.path.join(_dir(runsc_root"): "runsc records under the runsc root (root-only)",
    ("sandbox/runsc/runner.py", "open(output, 'ab')"): "runsc's output in the operation's own 0700 staging directory",
    ("sandbox/runsc/runner.py", "open(os.path.join(self.log_dir"): "runsc logs in the operation's own staging directory",
    ("sandbox/runsc/snapshot.py", "open(os.path.join(bundle, 'config.json'), 'w')"): "the bundle gpusnap makes",
    ("sandbox/runsc/snapshot.py", "open(output, 'rb')"): "runsc's output in the operation's own 0700 staging directory",
    ("sandbox/runsc/snapshot.py", "open(output, 'ab')"): "runsc's output in the operation's own 0700 staging directory",
    ("sandbox/runsc/snapshot.py", "open(spec_path)"): "the operator's OCI spec",
    ("storage/archive/filetree.py", "open(os.path.join(d, 'scanned'), 'w')"): "test hook (GPUSNAP_TEST_PAUSE_AFTER_SCAN only)",
    ("storage/base/pausepoint.py", "open(path + '.tmp', 'w')"): "test hook (GPUSNAP_TEST_PAUSE only)",
    ("storage/remote/client.py", "open(path, 'w')"): "test hook (GPUSNAP_TEST_PAUSE_TRANSFER only)",
}


def _names(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """Every simple `NAME = EXPR` or `NAME |= EXPR` in TREE (module or function level): NAME's values."""
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, []).append(node.value)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, []).append(node.value)
    return out


def _flags(expr: ast.expr, names: dict[str, list[ast.expr]], depth: int = 0) -> str:
    """EXPR's source with the values of the names it is built from, resolved (a few levels deep)."""
    out = ast.unparse(expr)
    if depth < 4:
        for n in ast.walk(expr):
            if isinstance(n, ast.Name):
                out += " " + " ".join(_flags(v, names, depth + 1) for v in names.get(n.id, []))
    return out


def _kernel(call: ast.Call) -> bool:
    if not call.args:
        return False
    src = ast.unparse(call.args[0])
    return src.startswith(("'/proc", "f'/proc", "'/sys", "f'/sys", '"/proc', '"/sys'))


def blocking_opens() -> list[str]:
    found = []
    for base in ("storage", "sandbox"):
        for p in sorted((REPO / base).rglob("*.py")):
            rel = p.relative_to(REPO).as_posix()
            tree = ast.parse(p.read_text())
            names = _names(tree)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                fn = ast.unparse(node.func)
                if fn not in ("os.open", "open", "io.open") or _kernel(node):
                    continue
                src = ast.unparse(node)
                if fn == "os.open" and len(node.args) > 1:
                    if any(f in _flags(node.args[1], names) for f in SAFE_FLAGS):
                        continue
                if any(f == rel and frag in src for f, frag in ALLOWED):
                    continue
                found.append(f"{rel}:{node.lineno}: {src[:120]}")
    return found


def test_every_open_of_a_plantable_path_is_non_blocking_or_explained() -> None:
    left = blocking_opens()
    assert left == [], "opens that a planted FIFO could block (add O_NONBLOCK and check the fd, or explain in ALLOWED):\n" \
        + "\n".join(left)


def test_every_allowed_exception_still_exists() -> None:
    """An ALLOWED entry whose call is gone is removed (the list names only what is there)."""
    srcs = {}
    for f, frag in ALLOWED:
        if f not in srcs:
            tree = ast.parse((REPO / f).read_text())
            srcs[f] = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
        assert any(frag in s for s in srcs[f]), (f, frag)
