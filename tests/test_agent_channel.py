"""The GPU agent's channel (sandbox/gpu/channel.py) with the driver stand-in: the agent's real code on
one end of real pipes (its regions real memory, copied by the host device), the host's real store on
the other; and the host refusing whatever a hostile agent sends beyond its own checkpoint."""
from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from support.driver_standin import StandInDriver
from sandbox.gpu.channel import (AgentFrames, ChannelError, ChannelLimits, read_report, receive, report_frame, send,
                                 write_header)
from sandbox.gpu.driver import ProcessState as S
from storage.gpu.device import HostDevice
from storage.repo.store import SnapshotStore
from support.custom_storage import FEATS, gpu_bytes


class Agent:
    """agents.gpu_agent.run on a thread, its stdout/stdin real pipes; the report frame last, as main() writes it."""

    def __init__(self, action: str, d: StandInDriver, pids: list[int], path: str | None = None) -> None:
        from agents.gpu_agent import run
        r_out, w_out = os.pipe()
        r_in, w_in = os.pipe()
        self.out = os.fdopen(r_out, "rb")           # the host reads the agent's stdout here
        self.inp = os.fdopen(w_in, "wb")            # and writes its stdin here
        a_out, a_in = os.fdopen(w_out, "wb"), os.fdopen(r_in, "rb")
        self.error: BaseException | None = None

        def body() -> None:
            try:
                rep = run(action, out=a_out, inp=a_in, path=path, driver=d, features=FEATS, device=HostDevice(),
                          pids=pids)
                write_header(a_out, report_frame(rep))
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                self.error = e
            finally:
                for f in (a_out, a_in):
                    try:
                        f.close()
                    except OSError:
                        pass

        self.t = threading.Thread(target=body, daemon=True)
        self.t.start()

    def close(self) -> None:
        for f in (self.out, self.inp):
            try:
                f.close()
            except OSError:
                pass
        self.t.join(30)
        assert not self.t.is_alive()


def fleet(*pids: int) -> StandInDriver:
    d = StandInDriver()
    for i, p in enumerate(pids):
        d.add(p, gpu_bytes(20 + i, 2))
    return d


def checkpoint_into(st: SnapshotStore, name: str, d: StandInDriver, pids: list[int]) -> AgentFrames:
    a = Agent("checkpoint", d, pids)
    try:
        with st.writer(name, meta={"kind": "gpu", "path": "custom-storage"}) as w:
            frames = AgentFrames(a.out, "checkpoint")
            receive(frames, w)
            w.commit()
    finally:
        a.close()
    assert a.error is None
    return frames


def restore_from(st: SnapshotStore, name: str, d: StandInDriver, pids: list[int]) -> dict[str, Any]:
    a = Agent("restore", d, pids, path="custom-storage")
    try:
        sent = send(a.inp, a.out, st, st.load(name).streams)
        a.inp.close()
        rep = read_report(a.out, "restore")
    finally:
        a.close()
    assert a.error is None
    return {"sent": sent, **rep.as_dict()}


def test_gpu_memory_goes_to_the_host_store_and_back_over_the_agent_pipes(tmp_path: Path, child: int) -> None:
    me = os.getpid()
    d = fleet(me, child)
    before = {p: bytes(d.procs[p].gpu) for p in (me, child)}
    st = SnapshotStore(str(tmp_path / "store"))
    frames = checkpoint_into(st, "sb.gpu", d, [me, child])
    assert frames.report is not None and frames.report.path == "custom-storage"
    assert frames.report.states == {str(me): "CHECKPOINTED", str(child): "CHECKPOINTED"}
    assert frames.complete == {me: [0], child: [0]}
    assert all(d.get_state(p) == S.CHECKPOINTED and len(d.procs[p].gpu) == 0 for p in (me, child))
    m = st.load("sb.gpu")
    assert {s.name: s.size for s in m.streams} == {f"gpu/{me}/0": len(before[me]), f"gpu/{child}/0": len(before[child])}
    assert st.verify(["sb.gpu"]).ok
    rep = restore_from(st, "sb.gpu", d, [me, child])
    assert rep["sent"] == [me, child] and rep["states"] == {str(me): "RUNNING", str(child): "RUNNING"}
    assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before
    # a second restore is harmless: nothing is needed, nothing is sent
    assert restore_from(st, "sb.gpu", d, [me, child])["sent"] == []
    assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before


def test_host_failure_mid_checkpoint_gives_every_process_its_memory_back(tmp_path: Path, child: int) -> None:
    """The host refuses the second process's region (over its byte limit): it stops reading, the agent
    rolls that process back from its spill; the first, already with the host, gets its memory back
    through the agent's restore from the uncommitted writer. No snapshot is left."""
    me = os.getpid()
    d = fleet(me, child)
    before = {p: bytes(d.procs[p].gpu) for p in (me, child)}
    st = SnapshotStore(str(tmp_path / "store"))
    a = Agent("checkpoint", d, [me, child])
    frames = AgentFrames(a.out, "checkpoint", ChannelLimits(max_total=len(before[me]) + 10))
    with pytest.raises(ChannelError, match="more than"):
        with st.writer("sb.gpu", meta={"kind": "gpu"}) as w:
            try:
                receive(frames, w)
            except ChannelError:
                a.close()                     # our ends closed: the agent's next write fails
                assert a.error is not None and "is with the host" in str(a.error)
                assert frames.complete == {me: [0]}
                assert d.get_state(child) == S.RUNNING and bytes(d.procs[child].gpu) == before[child]
                assert d.get_state(me) == S.CHECKPOINTED
                b = Agent("restore", d, [me, child], path="custom-storage")
                try:
                    assert send(b.inp, b.out, w.source, w.streams, frames.complete) == [me]
                    b.inp.close()
                    assert read_report(b.out, "restore").states == {str(me): "RUNNING", str(child): "RUNNING"}
                finally:
                    b.close()
                raise
    assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before
    assert st.names() == []


def hostile(*frames: bytes) -> io.BufferedReader:
    return io.BufferedReader(io.BytesIO(b"".join(frames)))


def hdr(**h: Any) -> bytes:
    return json.dumps(h).encode() + b"\n"


REPORT = hdr(t="report", action="checkpoint", cuda_pids=[7], path="custom-storage", states={"7": "CHECKPOINTED"})


@pytest.mark.parametrize("stream, why", [
    (hdr(t="region", pid="../../etc", index=0, size=4) + b"abcd" + REPORT, "bad pid"),
    (hdr(t="region", pid=7, index=-1, size=4) + b"abcd" + REPORT, "bad GPU index"),
    (hdr(t="region", pid=7, index=0, size=True) + REPORT, "bad region size"),
    (hdr(t="region", pid=7, index=0, size=1 << 40) + REPORT, "bad region size"),
    (hdr(t="region", pid=7, index=0, size=4) + b"ab", "ended inside pid 7 GPU 0"),
    (hdr(t="region", pid=7, index=0, size=2) + b"ab" + hdr(t="region", pid=7, index=0, size=2) + b"ab" + REPORT, "twice"),
    (b"{" + b" " * 5000 + b"}\n" + REPORT, "over 4096 bytes"),
    (b"not json\n", "not JSON"),
    (b"[" * 2000 + b"]" * 2000 + b"\n" + REPORT, "nested too deeply"),
    (hdr(t="store", name="other", path="/var/lib/gpusnap") + REPORT, "unexpected 'store'"),
    (hdr(t="region", pid=7, index=0, size=2) + b"ab", "without a report"),
    (b"".join(hdr(t="region", pid=1 + i // 256, index=i % 256, size=0) for i in range(4097)) + REPORT,
     "more than 4096 GPU regions"),
    (hdr(t="report", action="checkpoint", cuda_pids=["x"], path=None), "bad pid"),
    (hdr(t="report", action="checkpoint", cuda_pids=[7], path="/tmp/x"), "unknown path"),
    (hdr(t="report", action="restore", cuda_pids=[7], path=None), "answered 'restore'"),
])
def test_the_host_refuses_what_a_hostile_agent_sends(tmp_path: Path, stream: bytes, why: str) -> None:
    st = SnapshotStore(str(tmp_path / "store"))
    with pytest.raises(ChannelError, match=why):
        with st.writer("sb.gpu", meta={"kind": "gpu"}) as w:
            receive(AgentFrames(hostile(stream), "checkpoint", ChannelLimits(max_region=1 << 20)), w)
            w.commit()
    assert st.names() == []


def test_restore_sends_only_what_the_host_holds(tmp_path: Path, child: int) -> None:
    """An agent asking for a process the snapshot does not hold (or whose memory did not fully arrive)
    gets nothing; an agent asking for one it does hold gets exactly that process's bytes."""
    d = fleet(child)
    before = bytes(d.procs[child].gpu)
    st = SnapshotStore(str(tmp_path / "store"))
    checkpoint_into(st, "sb.gpu", d, [child])
    streams = st.load("sb.gpu").streams
    sink = io.BytesIO()
    with pytest.raises(ChannelError, match=r"pid\(s\) \[1\]"):
        send(sink, hostile(hdr(t="need", pids=[1])), st, streams)
    with pytest.raises(ChannelError, match="bad pid"):
        send(sink, hostile(hdr(t="need", pids=[0])), st, streams)
    with pytest.raises(ChannelError, match=r"pid\(s\) \[%d\]" % child):
        send(sink, hostile(hdr(t="need", pids=[child])), st, streams, have={})
    assert sink.getvalue() == b""
    assert send(sink, hostile(hdr(t="need", pids=[child])), st, streams) == [child]
    head, body = sink.getvalue().split(b"\n", 1)
    assert json.loads(head) == {"t": "region", "pid": child, "index": 0, "size": len(body)}
    assert body == before


def test_the_agent_and_its_host_staged_toggle(child: int) -> None:
    """toggle (runsc's save/restore exec) keeps to the driver's host copy, whatever the driver offers."""
    d = fleet(child)
    before = bytes(d.procs[child].gpu)
    sink = io.BytesIO()
    from agents.gpu_agent import run
    kw: dict[str, Any] = dict(out=sink, driver=d, features=FEATS, device=HostDevice(), pids=[child])
    assert run("toggle", **kw)["states"] == {str(child): "CHECKPOINTED"} and d.procs[child].host == bytearray(before)
    assert run("toggle", **kw)["states"] == {str(child): "RUNNING"} and bytes(d.procs[child].gpu) == before
    assert sink.getvalue() == b""
