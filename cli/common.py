"""What every command module of the CLI shares: one-line errors, JSON/text output, the store option."""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click

from storage.api import EXIT_FAILED, GpusnapError
from storage.api import DEFAULT_JOBS
from storage.api import apply_switch_interval
from storage.api import SnapshotStore

def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def rate(nbytes: int, seconds: float) -> str:
    """' (N.NN GB/s)' for a report line, or nothing where the figure would say nothing (under 10 MB,
    or under 50 ms: a tiny put is all start-up, and `(0.00 GB/s)` read as a fault)."""
    return f" ({nbytes / seconds / 1e9:.2f} GB/s)" if nbytes >= 10_000_000 and seconds >= 0.05 else ""


def fail(message: str, code: int = EXIT_FAILED, as_json: bool = False) -> None:
    """Exit CODE with `gpusnap: MESSAGE` on stderr (and, under --json, {"error", "exit_code"} on stdout)."""
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": code}))
    click.echo(f"gpusnap: {message}", err=True)
    sys.exit(code)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `git log | head` gives: the reader went away, said nothing


def quiet_broken_pipe() -> None:
    """The reader of stdout went away (`gpusnap store cat ... | head`): exit 141 without a word, as a
    process killed by SIGPIPE would (stdout pointed at /dev/null so the exit's flush cannot fail)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    os._exit(EXIT_BROKEN_PIPE)


class Terminated(Exception):
    """SIGTERM arrived while a command that cleans up after itself ran (terminate_cleanly)."""


EXIT_TERMINATED = 128 + signal.SIGTERM


@contextmanager
def terminate_cleanly() -> Iterator[None]:
    """For the block, SIGTERM raises Terminated in the main thread, so the command unwinds as on any error
    (its context managers remove what it made); a second SIGTERM is ignored until then. SIGKILL is
    what gc is for."""
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run FN; a GpusnapError or OSError becomes `gpusnap: <reason>` on stderr and its exit code
    (under --json also a JSON error object on stdout; the traceback instead with GPUSNAP_DEBUG=1)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            apply_switch_interval()
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            fail("interrupted; nothing was committed", 130, kwargs.get("as_json", False))
        except BrokenPipeError:
            quiet_broken_pipe()
        except Terminated:
            fail("terminated (SIGTERM); nothing was committed, what it had made is removed", EXIT_TERMINATED,
                 kwargs.get("as_json", False))
        except GpusnapError as e:
            if os.environ.get("GPUSNAP_DEBUG"):
                raise
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__, e.exit_code, kwargs.get("as_json", False))
        except OSError as e:
            if os.environ.get("GPUSNAP_DEBUG"):
                raise
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}", EXIT_FAILED, kwargs.get("as_json", False))
    return wrapper


def _since_boot() -> float:
    import time
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _process_started() -> float | None:
    """When this process started, in seconds since boot (/proc/self/stat field 22)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


COMMAND_STARTED = _since_boot()  # once the CLI's modules are imported: what came before is start-up


# report.seconds keys that lie inside another one (criu_dump and the ingest after it inside
# dump+ingest; the remote fill's marks are times since it began, not stages), not added again
_INSIDE = {"criu_dump", "ingest_after_dump", "gpu_resume", "criu_started", "tree_running", "all_local"}


def _stage_seconds(data: dict[str, Any]) -> float:
    s = data.get("seconds")
    if isinstance(s, (int, float)):
        return float(s)
    if isinstance(s, dict):
        return float(sum(v for k, v in s.items() if isinstance(v, (int, float)) and k not in _INSIDE))
    return 0.0


def wall(data: dict[str, Any]) -> dict[str, Any]:
    """The whole command's wall time and what it was: start-up (the interpreter and the imports),
    the stages the report already times, waits (locks, the fsyncs of a commit, a tree's death;
    storage/base/waits.py) and the rest (scanning, loading, journaling, cleaning up)."""
    from storage.api import waits
    now = _since_boot()
    started = _process_started()
    total = now - started if started is not None else now - COMMAND_STARTED
    startup = max(0.0, COMMAND_STARTED - started) if started is not None else 0.0
    stages = _stage_seconds(data)
    w = {k: round(v, 3) for k, v in waits.totals().items()}
    other = max(0.0, total - startup - stages - sum(w.values()))
    return {"total_s": round(total, 3), "startup_s": round(startup, 3), "stages_s": round(stages, 3),
            "waits_s": w, "other_s": round(other, 3)}


def wall_line(wl: dict[str, Any]) -> str:
    names = {"locks": "locks", "fsync": "fsync", "tree_death": "the tree's death"}
    waited = ", ".join(f"{names.get(k, k)} {v:.2f} s" for k, v in wl["waits_s"].items() if v >= 0.005)
    return (f"wall {wl['total_s']:.2f} s: {wl['stages_s']:.2f} s in the stages, {wl['startup_s']:.2f} s start-up, "
            f"waiting {waited or 'none'}, {wl['other_s']:.2f} s other")


def emit(ctx_json: bool, data: Any, text: str) -> None:
    """DATA as JSON, or TEXT. A report that times its stages (a `seconds` key) also gets `wall`: the
    whole command's time and what the rest of it was."""
    if isinstance(data, dict) and "seconds" in data:
        data = {**data, "wall": wall(data)}
        text = f"{text}\n  {wall_line(data['wall'])}"
    click.echo(json.dumps(data, indent=2, sort_keys=True) if ctx_json else text)


def _json_anywhere(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """--json given after the command, or before it as a global option (`gpusnap --json store ls`)."""
    root = ctx.find_root().obj
    return bool(value or (isinstance(root, dict) and root.get("json")))


json_option = click.option("--json", "as_json", is_flag=True, callback=_json_anywhere,
                           help="Print a JSON report instead of text (also accepted before the command: "
                                "`gpusnap --json store ls`).")

tag_option = click.option("--tag", "tags", multiple=True, metavar="TAG",
                          help="Tag the snapshot (repeatable; `store ls --tag`, `store forget --tag` select by it).")
from_remote_option = click.option(
    "--from", "from_remote", default=None, metavar="REMOTE",
    help="Pull the snapshot from REMOTE when this store lacks it (each chunk verified on arrival).")
from_jobs_option = click.option("--jobs", "-j", "jobs", default=DEFAULT_JOBS, show_default=True,
                                help="With --from: requests to the remote in flight at once.")


def open_store(ctx: click.Context, create: bool = True) -> SnapshotStore:
    return SnapshotStore(ctx.obj["store"], create=create)


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", re.I)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'4M', '64G', '512KiB', '4096' -> bytes (binary units); a click usage error otherwise."""
    m = _SIZE_RE.fullmatch(text)
    if not m:
        raise click.BadParameter(f"{text!r}: expected a size like 4M or 64G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_chunk_size(text: str) -> int:
    """A chunk size: a multiple of 4 KiB between 64 KiB and 1 GiB."""
    v = parse_size(text)
    if v < 64 << 10 or v > 1 << 30 or v % 4096:
        raise click.BadParameter(f"{text!r}: chunk size must be a multiple of 4 KiB between 64K and 1G")
    return v


def split_map(items: tuple[str, ...]) -> list[str]:
    """--device-map values, each OLD=NEW or several comma-separated (`0=1,1=0`), as one list."""
    return [part for item in items for part in item.split(",")]


# every kind `store ls` can show: sandbox/ops/snapshot_meta.py's SnapshotKind and the container
# runtimes' checkpoints (sandbox/containers/checkpoint_archive.py), named here so that `--help` imports
# neither (tests/test_switch.py checks the two lists agree)
SNAPSHOT_KINDS = ("files", "gpu", "criu", "runsc", "podman-checkpoint", "runc-checkpoint")

LATEST = "latest"  # the alias of get/cat/ls/inspect: the newest matching snapshot (never a new name)
_TEMPLATE_RE = re.compile(r"\{(now|utcnow|hostname)(?::([^{}]*))?\}")
NOW_FORMAT = "%Y-%m-%dT%H-%M-%S"


def expand_name(template: str) -> str:
    """A snapshot name from TEMPLATE (borg's placeholders): {now} (local time, 2026-12-07T17-32-37),
    {utcnow}, {now:STRFTIME} / {utcnow:STRFTIME}, {hostname} (characters a name cannot hold become
    -). Any other brace, or a result that is no valid name (or is `latest`), is InvalidNameError (exit 2)."""
    import socket
    from datetime import datetime, timezone
    from storage.api import InvalidNameError, validate_snapshot_name

    def one(m: re.Match[str]) -> str:
        key, fmt = m.group(1), m.group(2)
        if key == "hostname":
            if fmt is not None:
                raise InvalidNameError(f"{m.group(0)!r}: {{hostname}} takes no format")
            return re.sub(r"[^A-Za-z0-9_.+=@-]", "-", socket.gethostname()) or "host"
        now = datetime.now(timezone.utc) if key == "utcnow" else datetime.now()
        return now.strftime(fmt or NOW_FORMAT)
    name = _TEMPLATE_RE.sub(one, template)
    if "{" in name or "}" in name:
        raise InvalidNameError(f"snapshot name {template!r}: the placeholders are {{now}}, {{utcnow}}, "
                               "{now:FORMAT}, {hostname}")
    if name == LATEST:
        raise InvalidNameError(f"snapshot name {LATEST!r} means the newest snapshot in get/cat/ls/inspect; "
                               "choose another name")
    try:
        return validate_snapshot_name(name)
    except InvalidNameError as e:
        if name == template:
            raise
        raise InvalidNameError(f"{template!r} gives {e}") from None


def latest_options(with_tag: bool = True) -> Callable[[Any], Any]:
    """--path/--host (and --tag) that narrow what NAME `latest` resolves to."""
    def deco(fn: Any) -> Any:
        fn = click.option("--host", "latest_host", default=None, metavar="HOST",
                          help="With NAME latest: snapshots written on HOST (default: this machine; "
                               "'*' for any).")(fn)
        fn = click.option("--path", "latest_paths", multiple=True, metavar="PATH",
                          help="With NAME latest: only snapshots of exactly these input paths (repeatable; "
                               "as given to `store put`).")(fn)
        if with_tag:
            fn = click.option("--tag", "tags", multiple=True, metavar="TAG",
                              help="With NAME latest: only snapshots carrying this tag (repeatable).")(fn)
        return fn
    return deco


def resolve_name(st: SnapshotStore, name: str, tags: tuple[str, ...] = (), paths: tuple[str, ...] = (),
                 host: str | None = None) -> str:
    """NAME, checked; or for `latest` the newest `files` snapshot of HOST (default this machine's; '*'
    any) with exactly PATHS (when given) and every tag in TAGS (restic's `latest`)."""
    from storage.api import StoreError, find_latest, validate_snapshot_name
    if name != LATEST:
        if tags or paths or host is not None:
            raise click.UsageError("--tag/--path/--host choose what `latest` is; give them with NAME latest")
        return validate_snapshot_name(name)
    import socket
    want_host = None if host == "*" else (host or socket.gethostname())
    want_paths = tuple(os.path.abspath(p) for p in paths) or None
    found = find_latest(st, host=want_host, paths=want_paths, tags=tags)
    if found is None:
        what = [f"host {want_host}" if want_host else "any host"]
        what += [f"paths {', '.join(want_paths)}"] if want_paths else []
        what += [f"tags {', '.join(tags)}"] if tags else []
        raise StoreError(f"no files snapshot for `latest` ({'; '.join(what)}) in {st.path}")
    return found
