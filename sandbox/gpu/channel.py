"""The in-sandbox GPU agent's channel to the host: its own checkpoint's GPU bytes over its stdin/stdout.

A GPU sandbox gets no store. Where the driver has custom storage, the agent (agents/gpu_agent.py,
started by `runsc exec`) hands each process's mapped GPU memory to the host over its stdout and takes
it back over its stdin; the host chunks, hashes and commits the bytes through the normal store
writer, into the snapshot the HOST names, under stream names the host formats (gpu/PID/INDEX).

Frames, each a JSON header line of at most MAX_HEADER bytes, "region" headers followed by exactly
`size` raw bytes:
  agent -> host   {"t": "region", "pid": P, "index": I, "size": N} + N bytes   (checkpoint)
                  {"t": "need", "pids": [P, ...]}   (restore: the checkpointed processes it will fill)
                  {"t": "report", ...}               (last line, every action)
  host -> agent   {"t": "region", "pid": P, "index": I, "size": N} + N bytes   (restore, for the pids
                  it needs, in that order, each process's regions by index)

Trust: the host reads the agent's frames as hostile. Header lines are bounded, every field is type-
and range-checked (pids and indexes are integers in range, a region is at most the limit, the total
too, no (pid, index) twice), nothing from inside becomes a path, a snapshot name or a stream name
except through stream_name(int, int); a restore sends only the processes the host itself received
complete bytes for. The agent trusts the host (it runs it).
"""
from __future__ import annotations

import io
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator, cast

from storage.api import Progress
from storage.api import GpusnapError

from sandbox.gpu.driver import DeviceRegion, ProcessState
from sandbox.gpu.regions import stream_name

MAX_HEADER = 4096
MAX_PID = 1 << 22            # Linux's pid_max ceiling
MAX_INDEX = 255              # GPUs per process
MAX_PIDS = 4096
MAX_REGIONS = 4096           # (process, GPU) pairs in one checkpoint
MAX_INIT = 256               # characters of each init cmdline word kept from a report
PIECE = 16 << 20             # the agent's copy unit between device memory and the pipe
PATHS = ("host-staged", "custom-storage")


class ChannelError(GpusnapError):
    """The agent's channel carried something the host refuses, or ended early."""


@dataclass(frozen=True)
class ChannelLimits:
    max_region: int = 288 << 30      # one GPU's checkpoint (the largest data-center GPU's memory)
    max_total: int = 8 * (288 << 30)

    @classmethod
    def for_gpus(cls, n: int) -> "ChannelLimits":
        """A sandbox given N GPUs (0: unknown, e.g. devices from CDI) sends at most N GPUs' memory."""
        return cls(max_total=(n or 8) * cls.max_region)


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ChannelError(f"the GPU agent sent a bad {what}: {str(v)[:40]!r}")
    return v


def write_header(out: BinaryIO, header: dict[str, Any]) -> None:
    line = json.dumps(header, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_HEADER:
        raise ChannelError(f"a {header.get('t')} header is longer than {MAX_HEADER} bytes")
    out.write(line)


def read_header(f: BinaryIO) -> dict[str, Any] | None:
    """The next header line (None at a clean end of the stream); bounded, must be a JSON object."""
    line = f.readline(MAX_HEADER + 1)
    if not line:
        return None
    if len(line) > MAX_HEADER or not line.endswith(b"\n"):
        raise ChannelError(f"the GPU agent sent a header line over {MAX_HEADER} bytes (or cut short)")
    try:
        h = json.loads(line)
    except ValueError:
        raise ChannelError(f"the GPU agent sent a line that is not JSON: {line[:60]!r}") from None
    except RecursionError:  # 4096 bytes of '[' nest deeper than the parser's stack
        raise ChannelError("the GPU agent sent a header nested too deeply to be a frame") from None
    if not isinstance(h, dict) or not isinstance(h.get("t"), str):
        raise ChannelError("the GPU agent sent a header that is not a frame")
    return h


# --------------------------------------------------------------------------------------- reports
@dataclass(frozen=True)
class AgentReport:
    """What the host keeps of the agent's report, validated (never a name or path from inside)."""

    action: str
    cuda_pids: tuple[int, ...]
    path: str | None
    states: dict[str, str] = field(default_factory=dict)
    init: tuple[str, ...] = ()

    @classmethod
    def from_frame(cls, h: dict[str, Any], action: str) -> "AgentReport":
        pids = h.get("cuda_pids")
        if not isinstance(pids, list) or len(pids) > MAX_PIDS:
            raise ChannelError("the GPU agent's report has no valid cuda_pids")
        cuda = tuple(_int(p, 1, MAX_PID, "pid") for p in pids)
        path = h.get("path")
        if path is not None and path not in PATHS:
            raise ChannelError(f"the GPU agent's report names an unknown path {str(path)[:40]!r}")
        states_in = h.get("states") or {}
        if not isinstance(states_in, dict):
            raise ChannelError("the GPU agent's report has bad states")
        states = {}
        for k, v in states_in.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) in cuda and v in ProcessState.__members__):
                raise ChannelError("the GPU agent's report has bad states")
            states[k] = v
        init = h.get("init") or []
        if not isinstance(init, list) or not all(isinstance(a, str) for a in init):
            raise ChannelError("the GPU agent's report has a bad init")
        if h.get("action") != action:
            raise ChannelError(f"the GPU agent answered {str(h.get('action'))[:20]!r} to {action!r}")
        return cls(action, cuda, path, states, tuple(a[:MAX_INIT] for a in init[:2]))

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "cuda_pids": list(self.cuda_pids), "path": self.path,
                "states": dict(self.states), "init": list(self.init)}


def report_frame(report: dict[str, Any]) -> dict[str, Any]:
    return {"t": "report", **report}


# ------------------------------------------------------------------------------ the agent's side
class PipeRegions:
    """RegionStore (sandbox.gpu.state) of the in-sandbox agent: save() writes a process's mapped regions
    to OUT (the host), load() fills them from IN. DEV copies between device memory and host memory."""

    def __init__(self, dev: Any, out: BinaryIO | None, inp: BinaryIO | None) -> None:
        self.dev, self.out, self.inp = dev, out, inp

    @contextmanager
    def _staging(self, size: int) -> Iterator[tuple[Any, Any]]:
        buf = self.dev.pinned(max(1, min(PIECE, size)))
        stream = self.dev.new_stream()
        try:
            yield buf, stream
        finally:
            self.dev.destroy_stream(stream)
            buf.close()

    def save(self, pid: int, regions: list[DeviceRegion]) -> None:
        if self.out is None:
            raise ChannelError("no channel to the host to save GPU memory into")
        for r in sorted(regions, key=lambda r: r.index):
            write_header(self.out, {"t": "region", "pid": pid, "index": r.index, "size": r.size})
            with self._staging(r.size) as (buf, stream):
                for off in range(0, r.size, PIECE):
                    n = min(PIECE, r.size - off)
                    self.dev.d2h(buf.ptr, r.dev_ptr + off, n, stream)
                    self.dev.sync(stream)
                    self.out.write(buf.view[:n])
        self.out.flush()

    def load(self, pid: int, regions: list[DeviceRegion]) -> None:
        if self.inp is None:
            raise ChannelError(f"pid {pid}'s GPU memory is with the host; it gives it back through the "
                               "agent's restore")
        for r in sorted(regions, key=lambda r: r.index):
            h = read_header(self.inp)
            if h is None or h.get("t") != "region" or h.get("pid") != pid or h.get("index") != r.index:
                raise ChannelError(f"pid {pid} GPU {r.index}: the host sent {h!r:.80} instead of its memory")
            size = _int(h.get("size"), 0, r.size, "region size")
            with self._staging(r.size) as (buf, stream):
                for off in range(0, size, PIECE):
                    n = min(PIECE, size - off)
                    got = _readinto(self.inp, buf.view[:n])
                    while got < n:
                        more = _readinto(self.inp, buf.view[got:n])
                        if not more:
                            raise ChannelError(f"pid {pid} GPU {r.index}: the host's stream ended early")
                        got += more
                    self.dev.h2d(r.dev_ptr + off, buf.ptr, n, stream)
                    self.dev.sync(stream)
                if size < r.size:
                    self.dev.memset0(r.dev_ptr + size, r.size - size, stream)
                    self.dev.sync(stream)


def _readinto(f: BinaryIO, view: memoryview) -> int:
    """F.readinto(VIEW): every binary file the channel reads has it; typing.BinaryIO does not declare it."""
    return cast(io.BufferedIOBase, f).readinto(view) or 0


def send_need(out: BinaryIO, pids: list[int]) -> None:
    write_header(out, {"t": "need", "pids": pids})
    out.flush()


# ------------------------------------------------------------------------------- the host's side
class _Exactly:
    """A pipeline StreamReader for exactly N bytes of F (the region's bytes; an early end is an error)."""

    def __init__(self, f: BinaryIO, n: int, what: str) -> None:
        self.f, self.left, self.what = f, n, what

    def readinto(self, view: memoryview) -> int:
        want = min(len(view), self.left)
        got = 0
        while got < want:
            n = _readinto(self.f, view[got:want])
            if not n:
                raise ChannelError(f"the GPU agent's stream ended inside {self.what}")
            got += n
        self.left -= got
        return got


class AgentFrames:
    """A pipeline Source over the agent's checkpoint frames: one blob stream per region, named by the
    host; ends at the report. complete[pid] lists the GPU indexes whose bytes fully arrived."""

    def __init__(self, f: BinaryIO, action: str, limits: ChannelLimits = ChannelLimits()) -> None:
        self.f, self.action, self.limits = f, action, limits
        self.total = 0
        self.complete: dict[int, list[int]] = {}
        self.report: AgentReport | None = None
        self._seen: set[tuple[int, int]] = set()
        self._open: tuple[int, int, _Exactly] | None = None

    def _close_open(self) -> None:
        if self._open is not None:
            pid, index, r = self._open
            if r.left:
                raise ChannelError(f"pid {pid} GPU {index}: {r.left} bytes were not read")
            self.complete.setdefault(pid, []).append(index)
            self._open = None

    def streams(self) -> Iterator[Any]:
        from storage.api import StreamSpec
        while True:
            h = read_header(self.f)
            self._close_open()
            if h is None:
                raise ChannelError("the GPU agent ended without a report")
            if h["t"] == "report":
                self.report = AgentReport.from_frame(h, self.action)
                return
            if h["t"] != "region":
                raise ChannelError(f"the GPU agent sent an unexpected {h['t'][:20]!r} frame")
            pid = _int(h.get("pid"), 1, MAX_PID, "pid")
            index = _int(h.get("index"), 0, MAX_INDEX, "GPU index")
            size = _int(h.get("size"), 0, self.limits.max_region, "region size")
            if (pid, index) in self._seen:
                raise ChannelError(f"the GPU agent sent pid {pid} GPU {index} twice")
            if len(self._seen) >= MAX_REGIONS:
                raise ChannelError(f"the GPU agent sent more than {MAX_REGIONS} GPU regions")
            self.total += size
            if self.total > self.limits.max_total:
                raise ChannelError(f"the GPU agent sent more than {self.limits.max_total} bytes of GPU memory")
            self._seen.add((pid, index))
            self._open = (pid, index, _Exactly(self.f, size, f"pid {pid} GPU {index}"))
            yield StreamSpec(stream_name(pid, index), {"type": "blob", "device": "sandbox"}, size)

    @contextmanager
    def open(self, spec: Any) -> Iterator[_Exactly]:
        assert self._open is not None
        yield self._open[2]


def receive(frames: AgentFrames, writer: Any, progress: Progress | None = None) -> None:
    """Read the agent's checkpoint FRAMES into WRITER (chunked, hashed, written; the caller commits)
    until its report (frames.report; frames.complete: the processes whose memory fully arrived)."""
    from storage.api import put as pipeline
    pipeline.put(writer, frames, progress=progress)


def send(inp: BinaryIO, out: BinaryIO, source: Any, streams: list[Any], have: dict[int, list[int]] | None = None
         ) -> list[int]:
    """Answer the agent's restore: read its "need" frame from OUT, and write to INP the GPU memory of
    each process it needs, from STREAMS (gpu/PID/INDEX) read verified from SOURCE. HAVE: the processes
    (and their GPU indexes) the host may give back (default: every process in STREAMS). Returns the
    pids sent. Refuses a process it has no complete memory for."""
    from storage.api import AlignedBuffer
    by_pid: dict[int, list[Any]] = {}
    for s in streams:
        parts = s.name.split("/")
        if len(parts) == 3 and parts[0] == "gpu" and parts[1].isdigit() and parts[2].isdigit():
            by_pid.setdefault(int(parts[1]), []).append((int(parts[2]), s))
    allowed = have if have is not None else {p: [i for i, _ in v] for p, v in by_pid.items()}
    h = read_header(out)
    if h is None or h.get("t") != "need" or not isinstance(h.get("pids"), list) or len(h["pids"]) > MAX_PIDS:
        raise ChannelError("the GPU agent did not say which processes it restores")
    need = [_int(p, 1, MAX_PID, "pid") for p in h["pids"]]
    missing = [p for p in need if p not in allowed or p not in by_pid]
    if missing:
        raise ChannelError(f"the GPU agent asks for the GPU memory of pid(s) {missing[:8]}, which this "
                           "snapshot does not hold")
    buf = AlignedBuffer(source.chunk_buffer_size([_Chunks(s for v in by_pid.values() for _, s in v)]))
    try:
        for p in need:
            for i, s in sorted(by_pid[p], key=lambda t: t[0]):
                if i not in allowed[p]:
                    raise ChannelError(f"pid {p} GPU {i}: its memory did not fully reach the host")
                write_header(inp, {"t": "region", "pid": p, "index": i, "size": s.size})
                for c in s.chunks:
                    if c.is_zero:
                        _write_zeros(inp, c.raw_len)
                    else:
                        inp.write(source.read_raw(c, buf))  # decoded and bound to its id
        inp.flush()
    finally:
        buf.close()
    return need


class _Chunks:
    """Enough of a Manifest for SnapshotStore.chunk_buffer_size: the streams' chunks."""

    def __init__(self, streams: Iterator[Any]) -> None:
        self.streams = list(streams)


_ZEROS = bytes(1 << 20)


def _write_zeros(f: BinaryIO, n: int) -> None:
    while n:
        k = min(n, len(_ZEROS))
        f.write(_ZEROS[:k])
        n -= k


def read_report(out: BinaryIO, action: str) -> AgentReport:
    """The agent's last frame, its report (nothing else may come before it here)."""
    h = read_header(out)
    if h is None:
        raise ChannelError("the GPU agent ended without a report")
    if h.get("t") != "report":
        raise ChannelError(f"the GPU agent sent an unexpected {str(h.get('t'))[:20]!r} frame")
    return AgentReport.from_frame(h, action)
