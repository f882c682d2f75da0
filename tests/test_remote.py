"""The remote tier against a real OpenStack Swift with its S3 API (scripts/setup/swift-setup.sh starts it):
two stores stand for two nodes; push, pull, restore, kills, damage, an object store that goes away."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator, cast

import numpy as np
import pytest

from conftest import REPO, Cli
from support.criu import require_criu
from support.swift import CREDS, RUN, Node, drop_bucket, swift_start, url_for

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    ep = swift_start()
    yield ep
    drop_bucket(ep, f"gpusnap-test-{RUN}")


# what a push of a node with this env uploads: packs of one entry each, so that a kill or a pause
# "after N chunks" of a push, and of a pull of what it pushed, falls between two packs (between two
# range reads), as the protocol tests below need
ONE_ENTRY_PACKS = {"GPUSNAP_REMOTE_PACK_TARGET": "1"}


@pytest.fixture
def nodes(tmp_path: Path, endpoint: str, request: pytest.FixtureRequest) -> tuple[Node, Node]:
    url = url_for(request.node.name.replace("[", "-").replace("]", ""))
    return Node(tmp_path / "A", endpoint, url), Node(tmp_path / "B", endpoint, url)


@pytest.fixture(params=["s3", "file"])
def any_nodes(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Node, Node]:
    """As `nodes`, over each backend: the local Swift (s3://) and a shared directory (file://)."""
    if request.param == "s3":
        ep: str | None = request.getfixturevalue("endpoint")
        url = url_for(request.node.name.replace("[", "-").replace("]", ""))
    else:
        ep, url = None, f"file://{tmp_path / 'share'}"
    return Node(tmp_path / "A", ep, url), Node(tmp_path / "B", ep, url)


def make_data(d: Path, mb: int = 24, seed: int = 1) -> Path:
    d.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    (d / "big.bin").write_bytes(rng.integers(0, 256, mb << 20, dtype=np.uint8).tobytes())
    (d / "small.txt").write_text("hello from node A\n" * 100)
    (d / "sub").mkdir()
    (d / "sub" / "zeros.bin").write_bytes(bytes(3 << 20))
    return d


def same_tree(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a) for p in a.rglob("*"))
    fb = sorted(p.relative_to(b) for p in b.rglob("*"))
    return fa == fb and all((a / p).is_dir() or (a / p).read_bytes() == (b / p).read_bytes() for p in fa)


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the transfer did not reach the pause point"
        time.sleep(0.02)


def one_line(p: subprocess.CompletedProcess[str] | tuple[str, str]) -> str:
    err = p.stderr if isinstance(p, subprocess.CompletedProcess) else p[1]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_push_pull_restore_byte_identical(any_nodes: tuple[Node, Node], tmp_path: Path) -> None:
    nodes = any_nodes
    a, b = nodes
    data = make_data(tmp_path / "data")
    a.run("store", "put", "s1", str(data))
    pushed = a.json("push", "s1")
    assert pushed["chunks_sent"] == pushed["chunks_total"] > 0
    assert b.json("store", "ls") == []
    assert [s["name"] for s in b.json("remote", "ls")] == ["s1"]
    pulled = b.json("pull", "s1")
    assert pulled["chunks_sent"] == pulled["chunks_total"] == pushed["chunks_total"]
    b.run("store", "get", "s1", str(tmp_path / "out"))
    assert same_tree(data, tmp_path / "out" / "data")
    assert b.json("store", "verify")["ok"]
    assert b.json("store", "inspect", "s1")["created"] == a.json("store", "inspect", "s1")["created"]
    assert b.json("remote", "verify", "--read-data")["ok"]
    assert a.json("push", "s1")["already_there"] and b.json("pull", "s1")["already_there"]


def test_second_push_after_5_percent_change_sends_5_percent(nodes: tuple[Node, Node], tmp_path: Path) -> None:
    a, b = nodes
    data = make_data(tmp_path / "data", mb=40)
    a.run("store", "put", "v1", str(data), "--chunk-size", "1M", "--no-compress")
    first = a.json("push", "v1")
    big = bytearray((data / "big.bin").read_bytes())
    for i in range(2):  # 2 of 40 MiB rewritten: 5%, in two places
        off = (7 + 20 * i) << 20
        big[off:off + (1 << 20)] = np.random.default_rng(9 + i).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    (data / "big.bin").write_bytes(bytes(big))
    a.run("store", "put", "v2", str(data), "--chunk-size", "1M", "--no-compress")
    second = a.json("push", "v2")
    ratio = second["bytes_sent"] / first["bytes_sent"]
    assert 0.03 < ratio < 0.08, (first, second)
    assert second["chunks_sent"] == 2
    b.json("pull", "v1")
    again = b.json("pull", "v2")
    assert again["chunks_sent"] == 2 and again["bytes_sent"] / first["bytes_sent"] < 0.08
    b.run("store", "get", "v2", str(tmp_path / "out"))
    assert same_tree(data, tmp_path / "out" / "data")


def test_killed_push_leaves_no_snapshot_and_next_push_completes(nodes: tuple[Node, Node], tmp_path: Path) -> None:
    a, b = nodes
    a.env.update(ONE_ENTRY_PACKS)
    data = make_data(tmp_path / "data")
    a.run("store", "put", "k", str(data), "--chunk-size", "1M")
    pause = tmp_path / "paused"
    p = a.popen("push", "k", "--jobs", "1", env={"GPUSNAP_TEST_PAUSE_TRANSFER": f"4:{pause}"})
    wait_for(pause, p)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert b.json("remote", "ls") == []
    r = b.run("pull", "k", check=False)
    assert r.returncode == 1 and "no snapshot named 'k'" in one_line(r)
    done = a.json("push", "k")
    assert 0 < done["chunks_sent"] <= done["chunks_total"] - 4, done  # the 4 that arrived are not sent again
    b.json("pull", "k")
    b.run("store", "get", "k", str(tmp_path / "out"))
    assert same_tree(data, tmp_path / "out" / "data")
    # the killed push's lock is still fresh: gc refuses, until it is stale
    r = a.run("remote", "gc", check=False)
    assert r.returncode == 1 and "locked by a running push" in one_line(r)
    gc = a.json("remote", "gc", env={"GPUSNAP_REMOTE_LOCK_STALE_S": "0"})
    assert gc["stale_locks_removed"] == 1 and gc["chunks_removed"] == 0
    assert b.json("remote", "verify", "--read-data")["ok"]


def test_gc_deletes_only_unreferenced_chunks_and_a_push_it_raced_rechecks(nodes: tuple[Node, Node], tmp_path: Path) -> None:
    a, b = nodes
    a.env.update(ONE_ENTRY_PACKS)
    d1 = make_data(tmp_path / "d1", mb=8, seed=1)
    d2 = make_data(tmp_path / "d2", mb=8, seed=2)
    d3 = make_data(tmp_path / "d3", mb=8, seed=3)
    for name, d in (("g1", d1), ("g2", d2), ("g3", d3)):
        a.run("store", "put", name, str(d), "--chunk-size", "1M")
    a.json("push", "g1")
    a.json("push", "g2")
    a.run("remote", "forget", "g1")
    # a push paused after uploading some chunks holds a fresh lock: gc refuses
    pause = tmp_path / "paused"
    p = a.popen("push", "g3", "--jobs", "1", env={"GPUSNAP_TEST_PAUSE_TRANSFER": f"3:{pause}"})
    wait_for(pause, p)
    r = a.run("remote", "gc", check=False)
    assert r.returncode == 1 and "locked by a running push" in one_line(r)
    # a gc that takes that lock for stale deletes g1's chunks and the 3 the push had sent ...
    gc = a.json("remote", "gc", env={"GPUSNAP_REMOTE_LOCK_STALE_S": "0"})
    assert gc["stale_locks_removed"] == 1 and gc["chunks_removed"] >= 8 + 3, gc
    # ... and the push, resumed, finds its lock gone, checks again and sends them again before committing
    pause.unlink()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    rep = json.loads(out)
    # every chunk of g3 but small.txt's (shared with g2) once, then the 3 gc deleted again
    assert rep["rechecked_after_gc"] and rep["chunks_sent"] == rep["chunks_total"] - 1 + 3, rep
    assert b.json("remote", "verify", "--read-data")["ok"]
    assert [s["name"] for s in b.json("remote", "ls")] == ["g2", "g3"]
    b.json("pull", "g3")
    b.run("store", "get", "g3", str(tmp_path / "out"))
    assert same_tree(d3, tmp_path / "out" / "d3")


def test_gc_waits_for_a_pull_and_one_that_takes_its_lock_for_stale_fails_it_cleanly(nodes: tuple[Node, Node],
                                                                                    tmp_path: Path) -> None:
    a, b = nodes
    a.env.update(ONE_ENTRY_PACKS)
    d1 = make_data(tmp_path / "d1", mb=8, seed=1)
    a.run("store", "put", "g1", str(d1), "--chunk-size", "1M")
    a.json("push", "g1")
    # a pull paused after fetching some chunks holds a fresh lock: the snapshot is removed remotely
    # meanwhile, and gc, which would now delete the chunks the pull has yet to fetch, refuses
    pause = tmp_path / "paused"
    p = b.popen("pull", "g1", "--jobs", "1", env={"GPUSNAP_TEST_PAUSE_TRANSFER": f"3:{pause}"})
    wait_for(pause, p)
    a.run("remote", "forget", "g1")
    r = a.run("remote", "gc", check=False)
    assert r.returncode == 1 and "locked by a running pull" in one_line(r)
    pause.unlink()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    b.run("store", "get", "g1", str(tmp_path / "out"))
    assert same_tree(d1, tmp_path / "out" / "d1")
    assert a.json("remote", "gc")["chunks_removed"] >= 8  # the pull has ended: now they go
    # a gc that takes a stopped pull's lock for stale deletes what it had yet to fetch: the pull fails
    # with one line and commits nothing
    b.run("store", "rm", "g1")
    b.run("store", "gc")
    a.json("push", "g1")
    p = b.popen("pull", "g1", "--jobs", "1", env={"GPUSNAP_TEST_PAUSE_TRANSFER": f"3:{pause}"})
    wait_for(pause, p)
    a.run("remote", "forget", "g1")
    gc = a.json("remote", "gc", env={"GPUSNAP_REMOTE_LOCK_STALE_S": "0"})
    assert gc["stale_locks_removed"] == 1 and gc["chunks_removed"] >= 8, gc
    pause.unlink()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, (out, err)
    assert "a gc took this pull's lock for stale" in one_line((out, err))
    assert b.json("store", "ls") == [] and not list((b.store / "tmp").iterdir())


def _s3(endpoint: str):  # the test's own client, to damage objects behind gpusnap's back
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test:tester",
                        aws_secret_access_key="testing",
                        config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


def _pushed_packs(a: Node, tmp_path: Path, endpoint: str, name: str, mb: int,
                  test: str) -> tuple[Any, str, str, list[tuple[str, list[tuple[str, int, int]]]]]:
    """MB of data put as snapshot NAME on node A (1 MiB chunks) and pushed; the test's own S3 client,
    the bucket, the remote's prefix (TEST names it) and its packs: (pack key, its index's entries)."""
    from storage.format.packs import decode_index
    a.run("store", "put", name, str(make_data(tmp_path / "data", mb=mb)), "--chunk-size", "1M")
    a.json("push", name)
    s3 = _s3(endpoint)
    bucket, prefix = url_for(test)[5:].split("/", 1)
    packs = []
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/index/")["Contents"]:
        pack = o["Key"].rsplit("/", 1)[1]
        _, ents = decode_index(pack, s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
        packs.append((f"{prefix}/packs/{pack}", ents))
    assert not s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/chunks/").get("Contents")  # no object per chunk
    return s3, bucket, prefix, packs


def test_corrupted_remote_pack_entry_is_refused_and_reported(nodes: tuple[Node, Node], tmp_path: Path,
                                                             endpoint: str) -> None:
    a, b = nodes
    s3, bucket, _, packs = _pushed_packs(a, tmp_path, endpoint, "c", 8,
                                         "test_corrupted_remote_pack_entry_is_refused_and_reported")
    assert len(packs) == 1 and len(packs[0][1]) >= 8  # 8 MiB of 1 MiB chunks: one pack, not 8+ objects
    key, ents = packs[0]
    _, off, _ = ents[len(ents) // 2]
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[off + 5000] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    r = b.run("remote", "verify", "--read-data", check=False)
    assert r.returncode == 3 and "does not match its hash" in r.stdout, r.stdout
    assert b.run("remote", "verify", check=False).returncode == 0  # presence and sizes are fine
    r = b.run("pull", "c", check=False)
    assert r.returncode == 3, r.stderr
    assert "does not match its hash" in one_line(r) and "fetched twice" in r.stderr
    assert b.json("store", "ls") == []
    assert not list((b.store / "tmp").iterdir())
    # a pack shorter than its index says is seen by a cheap verify and by a pull, and the next push
    # sends its chunks again, in a new pack
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body[:off + 100]))
    r = b.run("remote", "verify", check=False)
    assert r.returncode == 3 and "bytes on the remote" in r.stdout, r.stdout
    r = b.run("pull", "c", check=False)
    assert r.returncode == 3 and "shorter than its index says" in one_line(r), r.stderr
    again = a.json("push", "c")
    assert again["chunks_sent"] == again["chunks_total"] and again["packs_sent"] == 1, again
    assert b.json("remote", "verify", "--read-data")["ok"]
    pulled = b.json("pull", "c")
    assert pulled["ranges"] <= 2, pulled  # adjacent entries: one range read each 16 MiB
    assert a.json("remote", "gc")["packs_removed"] == 0  # the truncated pack still names live chunks


def test_forged_raw_addressed_entry_is_refused_by_pull(nodes: tuple[Node, Node], tmp_path: Path,
                                                       endpoint: str) -> None:
    """An entry whose stored checksum is sound but whose payload is other raw bytes (GSNPCHK2): the
    sizes and the stored check pass, the full check on arrival does not."""
    from storage.format.chunkfile import HEADER_SIZE, ChunkHeader
    a, b = nodes
    s3, bucket, _, packs = _pushed_packs(a, tmp_path, endpoint, "f", 4,
                                         "test_forged_raw_addressed_entry_is_refused_by_pull")
    key, ents = packs[0]
    cid, off, length = max(ents, key=lambda e: e[2])
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    hdr = ChunkHeader.unpack(bytes(body[off:off + 64]), cid)
    assert hdr.raw_id and hdr.codec == "raw"
    payload = np.random.default_rng(99).integers(0, 256, hdr.stored_len, dtype=np.uint8).tobytes()
    forged = hdr.with_checksum(payload)
    body[off:off + HEADER_SIZE + hdr.stored_len] = forged.pack().ljust(HEADER_SIZE, b"\0") + payload
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert b.run("remote", "verify", check=False).returncode == 0  # sizes are right
    r = b.run("remote", "verify", "--read-data", check=False)
    assert r.returncode == 3 and "does not match its hash" in r.stdout, r.stdout
    r = b.run("pull", "f", check=False)
    assert r.returncode == 3 and "does not match its hash" in one_line(r), r.stderr
    assert b.json("store", "ls") == []
    assert not list((b.store / "tmp").iterdir())


def test_forged_or_lost_index_object_is_damage_and_a_push_repairs_it(nodes: tuple[Node, Node], tmp_path: Path,
                                                                     endpoint: str) -> None:
    """An index object that is not what it claims (here: another pack's index under this pack's key) is
    refused by its own check before any of it is used; the chunks it lists read as missing, and the next
    push uploads them again."""
    a, b = nodes
    test = "test_forged_or_lost_index_object_is_damage_and_a_push_repairs_it"
    s3, bucket, prefix, packs = _pushed_packs(a, tmp_path, endpoint, "x", 4, test)
    key = packs[0][0].replace("/packs/", "/index/")
    from storage.format.packs import encode_index
    forged = encode_index("0" * 32, 1 << 30, [(cid, off, n) for cid, off, n in packs[0][1]])
    s3.put_object(Bucket=bucket, Key=key, Body=forged)
    r = b.run("remote", "verify", check=False)
    assert r.returncode == 3 and "names pack 000000" in r.stdout, r.stdout
    r = b.run("pull", "x", check=False)
    assert r.returncode == 3 and "missing on the remote" in one_line(r), r.stderr
    assert b.json("store", "ls") == []
    again = a.json("push", "x")
    assert again["chunks_sent"] == again["chunks_total"], again
    b.json("pull", "x")
    assert b.json("store", "verify")["ok"]


def test_remote_of_one_object_per_chunk_is_still_read(nodes: tuple[Node, Node], tmp_path: Path,
                                                      endpoint: str) -> None:
    """A version 1 remote (chunks/XY/<id>, what gpusnap wrote before packs): pulled and verified chunk
    by chunk without listing chunks/; the first push marks it version 2 and adds packs; gc then deletes
    the chunk objects a pack holds too."""
    import json as _json
    from storage.format.chunkfile import HEADER_SIZE
    from storage.format.packs import decode_index
    a, b = nodes
    test = "test_remote_of_one_object_per_chunk_is_still_read"
    s3, bucket, prefix, packs = _pushed_packs(a, tmp_path, endpoint, "old", 4, test)
    for key, ents in packs:  # rewrite the remote as version 1 wrote it
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        for cid, off, _ in ents:
            stored = int.from_bytes(body[off + 24:off + 32], "little")
            s3.put_object(Bucket=bucket, Key=f"{prefix}/chunks/{cid[:2]}/{cid}", Body=body[off:off + HEADER_SIZE + stored])
        s3.delete_object(Bucket=bucket, Key=key)
        s3.delete_object(Bucket=bucket, Key=key.replace("/packs/", "/index/"))
    s3.put_object(Bucket=bucket, Key=f"{prefix}/gpusnap-remote.json",
                  Body=_json.dumps({"format": "gpusnap-remote", "version": 1}).encode())
    assert b.json("remote", "verify", "--read-data")["ok"]
    pulled = b.json("pull", "old")
    assert pulled["chunks_sent"] == pulled["chunks_total"] > 0 and pulled["ranges"] == 0, pulled
    b.run("store", "get", "old", str(tmp_path / "out"))
    assert same_tree(tmp_path / "data", tmp_path / "out" / "data")
    a.run("store", "put", "new", str(tmp_path / "data"), "--chunk-size", "1M")
    assert a.json("push", "new")["packs_sent"] == 1  # into packs: the chunk objects are not listed
    marker = _json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/gpusnap-remote.json")["Body"].read())
    assert marker["version"] == 2
    gc = a.json("remote", "gc")
    assert gc["chunks_removed"] == 0 and gc["bytes_freed"] > 0, gc  # duplicates of packed chunks went
    assert not s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/chunks/").get("Contents")
    b.run("store", "rm", "old")
    b.run("store", "gc")
    b.json("pull", "old")
    assert b.json("store", "verify")["ok"]


def test_chunk_larger_than_the_multipart_threshold_goes_up_in_parts(nodes: tuple[Node, Node], tmp_path: Path,
                                                                   endpoint: str) -> None:
    a, b = nodes
    d = tmp_path / "data"
    d.mkdir()
    (d / "huge.bin").write_bytes(np.random.default_rng(5).integers(0, 256, 70 << 20, dtype=np.uint8).tobytes())
    a.run("store", "put", "m", str(d), "--chunk-size", "128M", "--no-compress")
    assert a.json("push", "m")["chunks_sent"] == 1
    bucket, prefix = url_for("test_chunk_larger_than_the_multipart_threshold_goes_up_in_parts")[5:].split("/", 1)
    s3 = _s3(endpoint)
    [obj] = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/packs/")["Contents"]
    assert obj["Size"] == 4096 + (70 << 20)  # a pack of that one entry, larger than the pack target
    assert obj["ETag"].strip('"').endswith("-5"), obj["ETag"]  # 16 MiB parts: a multipart upload
    b.json("pull", "m")
    b.run("store", "get", "m", str(tmp_path / "out"))
    assert same_tree(d, tmp_path / "out" / "data")


def test_credentials_wrong_missing_or_readable_by_others_give_one_line(tmp_path: Path, endpoint: str) -> None:
    cli = Cli(tmp_path / "A")
    no_env = {"GPUSNAP_S3_ACCESS_KEY_ID": "", "GPUSNAP_S3_SECRET_ACCESS_KEY": "",
              "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    url = url_for("creds")
    bad = {"GPUSNAP_S3_ACCESS_KEY_ID": "test:tester", "GPUSNAP_S3_SECRET_ACCESS_KEY": "not-the-secret-42"}
    r = cli.run("remote", "add", "r", url, "--endpoint", endpoint, check=False, env=bad)
    assert r.returncode == 1 and "refused the credentials" in one_line(r)
    assert "not-the-secret-42" not in r.stderr + r.stdout
    r = cli.run("remote", "add", "r", url, "--endpoint", endpoint, check=False, env=no_env)
    assert r.returncode == 1 and "no credentials" in one_line(r)
    cred = tmp_path / "creds"
    cred.write_text("access_key_id = test:tester\nsecret_access_key = testing\n")
    cred.chmod(0o644)
    r = cli.run("remote", "add", "r", url, "--endpoint", endpoint, "--credentials-file", str(cred),
                check=False, env=no_env)
    assert r.returncode == 1 and "readable by others" in one_line(r)
    cred.chmod(0o600)
    cli.run("remote", "add", "r", url, "--endpoint", endpoint, "--credentials-file", str(cred), env=no_env)
    cfg = (tmp_path / "A" / "remotes" / "r.json")
    assert "testing" not in cfg.read_text() and (cfg.stat().st_mode & 0o077) == 0
    assert json.loads(cli.run("remote", "ls", "--json", env=no_env).stdout) == []
    r = cli.run("remote", "ls", check=False, env=bad)
    assert r.returncode == 1 and "refused the credentials" in one_line(r)
    r = cli.run("remote", "ls", check=False, env={**bad, "GPUSNAP_S3_ACCESS_KEY_ID": "nobody:nouser"})
    assert r.returncode == 1 and "refused the credentials" in one_line(r)


# ---- Swift going away: a private instance on its own ports, so other tests keep theirs --------------
def _free_port_block() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 4 < 65536 and all(_port_free(base + i) for i in range(5)):
            return base


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def private_swift(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    env = {"GPUSNAP_SWIFT_DIR": str(tmp_path / "swift"), "GPUSNAP_SWIFT_PORT": str(_free_port_block())}
    ep = swift_start(env)
    yield ep, env
    subprocess.run([str(REPO / "scripts" / "setup" / "swift-setup.sh"), "stop"], env={**os.environ, **env}, check=False)


def test_swift_stopped_mid_transfer_gives_one_line_and_loses_nothing(private_swift: tuple[str, dict[str, str]],
                                                                    tmp_path: Path) -> None:
    ep, senv = private_swift
    url = url_for("down")
    a, b = Node(tmp_path / "A", ep, url), Node(tmp_path / "B", ep, url)
    a.env.update(ONE_ENTRY_PACKS)
    data = make_data(tmp_path / "data", mb=12)
    a.run("store", "put", "s", str(data), "--chunk-size", "1M")
    fast_fail = {"GPUSNAP_S3_MAX_ATTEMPTS": "2"}
    swift = [str(REPO / "scripts" / "setup" / "swift-setup.sh")]
    senv = {**os.environ, **senv}

    for direction, node in (("push", a), ("pull", b)):
        pause = tmp_path / f"paused-{direction}"
        p = node.popen(direction, "s", "--jobs", "1",
                       env={**fast_fail, "GPUSNAP_TEST_PAUSE_TRANSFER": f"3:{pause}"})
        wait_for(pause, p)
        subprocess.run([*swift, "stop"], env=senv, check=True)
        pause.unlink()
        out, err = p.communicate(timeout=120)
        assert p.returncode == 4, (out, err)
        assert "cannot reach the object store" in one_line((out, err))
        subprocess.run([*swift, "start"], env=senv, check=True, capture_output=True)
        # nothing lost: the local side is intact and no partial snapshot is visible anywhere
        assert a.json("store", "verify")["ok"]
        if direction == "push":
            assert b.json("remote", "ls") == []
            a.json("push", "s")
        else:
            assert b.json("store", "ls") == [] and not list((b.store / "tmp").iterdir())
            b.json("pull", "s")
    b.run("store", "get", "s", str(tmp_path / "out"))
    assert same_tree(data, tmp_path / "out" / "data")


# ---- CRIU restore on node B, straight from the object store ------------------------------------------
def _chunk_count(node: Node, name: str) -> int:
    from storage.repo.store import SnapshotStore
    return len(SnapshotStore(str(node.store)).load(name).chunk_ids())


def _gone(pid: int, timeout: float = 10) -> bool:
    from support.criu import _state
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_criu_restore_from_remote_on_another_store(any_nodes: tuple[Node, Node], tmp_path: Path) -> None:
    """`criu restore --from` on an empty store: CRIU starts while the pull runs. The one fetch thread
    is held before the snapshot's last chunk; CRIU must already have recreated the tree's processes
    then (a restore that waited for the whole pull could not), and nothing is visible locally yet.
    Over both backends (a file:// remote as a shared volume would be)."""
    require_criu()
    nodes = any_nodes
    from support.criu import Tree, healthy
    a, b = nodes
    a.env.update(ONE_ENTRY_PACKS)
    tree = Tree()
    try:
        assert healthy(tree.report())
        a.json("criu", "dump", str(tree.pid), "t")
        tree.reap()
        assert not tree.alive()
        a.json("push", "t")
        assert b.json("store", "ls") == []
        total = _chunk_count(a, "t")
        pause = tmp_path / "paused"
        p = b.popen("criu", "restore", "t", "--from", "r", "--jobs", "1",
                    env={"GPUSNAP_TEST_PAUSE_TRANSFER": f"{total - 1}:{pause}"})
        wait_for(pause, p)
        deadline = time.monotonic() + 60
        while not os.path.exists(f"/proc/{tree.pid}"):  # CRIU recreates the tree with its pids
            assert p.poll() is None and time.monotonic() < deadline, "CRIU did not start before the last chunk"
            time.sleep(0.02)
        assert pause.exists() and b.json("store", "ls") == [], "the snapshot is committed only when all is local"
        pause.unlink()
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        r = json.loads(out)
        assert r["restored_pid"] == tree.pid
        assert r["stages"]["pull"]["chunks_sent"] == r["stages"]["pull"]["chunks_total"] == total
        assert r["seconds"]["criu_started"] < r["seconds"]["all_local"], r["seconds"]
        after = tree.report()
        assert healthy(after) and after["pid"] == tree.pid, after
        assert [s["name"] for s in b.json("store", "ls")] == ["t"]
        assert b.json("store", "verify")["ok"]
    finally:
        tree.kill()


def test_swift_stopped_mid_restore_fails_cleanly_and_a_retry_completes(private_swift: tuple[str, dict[str, str]],
                                                                       tmp_path: Path) -> None:
    """The object store stops while CRIU restores from it: one line, no process of the snapshot left,
    no snapshot visible in B; once it is back the same command completes, reusing what was fetched."""
    require_criu()
    from support.criu import Tree, healthy
    ep, senv = private_swift
    url = url_for("down-restore")
    a, b = Node(tmp_path / "A", ep, url), Node(tmp_path / "B", ep, url)
    a.env.update(ONE_ENTRY_PACKS)
    swift = [str(REPO / "scripts" / "setup" / "swift-setup.sh")]
    senv = {**os.environ, **senv}
    tree = Tree()
    try:
        pause = tmp_path / "paused"
        p, total = _restore_from_remote_paused(a, b, tree, pause, 3, {"GPUSNAP_S3_MAX_ATTEMPTS": "2"})
        deadline = time.monotonic() + 60
        while not os.path.exists(f"/proc/{tree.pid}"):  # mid-restore: CRIU has recreated the tree
            assert p.poll() is None and time.monotonic() < deadline, "CRIU did not start"
            time.sleep(0.02)
        subprocess.run([*swift, "stop"], env=senv, check=True)
        pause.unlink()
        out, err = p.communicate(timeout=180)
        assert p.returncode == 4, (out, err)
        assert "cannot reach the object store" in one_line((out, err))
        assert _gone(tree.pid) and _gone(tree.child), "a half-restored process was left"
        assert b.json("store", "ls") == [] and not list((b.store / "tmp").iterdir())
        subprocess.run([*swift, "start"], env=senv, check=True, capture_output=True)
        r = b.json("criu", "restore", "t", "--from", "r")
        assert r["restored_pid"] == tree.pid
        pulled = r["stages"]["pull"]
        assert pulled["chunks_total"] == total and pulled["chunks_sent"] == 3, pulled  # the rest was kept
        assert healthy(tree.report())
        assert [s["name"] for s in b.json("store", "ls")] == ["t"] and b.json("store", "verify")["ok"]
    finally:
        tree.kill()


def _restore_from_remote_paused(a: "Node", b: "Node", tree: Any, pause: Path, keep_back: int,
                                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """Node A dumps TREE as "t" and pushes it; node B starts `criu restore t --from r`, one fetch at a
    time, paused at PAUSE with KEEP_BACK chunks still to come. Returns B's process and the chunk count."""
    a.json("criu", "dump", str(tree.pid), "t")
    tree.reap()
    a.json("push", "t")
    total = _chunk_count(a, "t")
    p = b.popen("criu", "restore", "t", "--from", "r", "--jobs", "1",
                env={**(env or {}), "GPUSNAP_TEST_PAUSE_TRANSFER": f"{total - keep_back}:{pause}"})
    wait_for(pause, p)
    return p, total


def test_kill_9_mid_restore_from_remote_leaves_nothing_visible_and_a_retry_reuses_the_chunks(
        nodes: tuple[Node, Node], tmp_path: Path) -> None:
    require_criu()
    from support.criu import Tree, healthy
    from support.criu import criu_of as _criu_of
    a, b = nodes
    a.env.update(ONE_ENTRY_PACKS)
    tree = Tree()
    try:
        pause = tmp_path / "paused"
        p, total = _restore_from_remote_paused(a, b, tree, pause, 2)
        criu = _criu_of(p)
        os.kill(p.pid, signal.SIGKILL)  # CRIU's pipes break: it fails and removes its tasks
        p.communicate(timeout=60)
        assert _gone(criu, 30) and _gone(tree.pid) and _gone(tree.child), "a half-restored process was left"
        assert b.json("store", "ls") == []
        b.json("recover")  # the killed command's journal record
        r = b.json("criu", "restore", "t", "--from", "r")
        assert r["restored_pid"] == tree.pid
        assert r["stages"]["pull"]["chunks_sent"] == 2, r["stages"]["pull"]  # what the killed one stored stays
        assert healthy(tree.report())
        assert [s["name"] for s in b.json("store", "ls")] == ["t"] and b.json("store", "verify")["ok"]
    finally:
        tree.kill()


# ---- a GPU snapshot (custom-storage streams) restored on node B from the object store ----------------
def test_gpu_restore_from_remote_on_another_store(tmp_path: Path, endpoint: str, child: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path of `gpu restore --from`: the driver stand-in's processes swapped out into store A,
    pushed, pulled by ensure_local into empty store B, swapped back in from B with the bytes intact."""
    from support.driver_standin import StandInDriver
    from support.custom_storage import FEATS, gpu_bytes
    from sandbox.gpu.driver import CudaDriver, ProcessState as S  # the stand-in, cast: FEATS given, probe() never runs
    from sandbox.gpu.snapshot import gpu_checkpoint, gpu_restore
    from storage.gpu.device import HostDevice
    from storage.remote.client import Remote, RemoteConfig, add_remote
    from storage.remote.fill import ensure_local
    from storage.repo.store import SnapshotStore
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    import storage.remote.client
    monkeypatch.setattr(storage.remote.client, "REMOTE_PACK_TARGET", 1)  # ONE_ENTRY_PACKS, in this process
    cfg = RemoteConfig.make("r", url_for("gpu"), endpoint)
    a, b = SnapshotStore(str(tmp_path / "A")), SnapshotStore(str(tmp_path / "B"))
    add_remote(a, cfg)
    add_remote(b, cfg)
    Remote.open(a, "r").init()
    d = StandInDriver()
    me = os.getpid()
    d.add(me, gpu_bytes(1, 6))
    d.add(child, gpu_bytes(2, 3))
    before = {p: bytes(d.procs[p].gpu) for p in (me, child)}
    gpu_checkpoint(a, me, "swap", driver=cast(CudaDriver, d), features=FEATS, device=HostDevice(), thp_mode=None)
    assert all(d.get_state(p) == S.CHECKPOINTED for p in (me, child))
    assert Remote.open(a, "r").push(a, "swap").chunks_sent > 0
    # B restores while it pulls: one fetch at a time, held for a second before the last chunk
    nchunks = len({c.id for s in a.load("swap").streams for c in s.chunks if c.id is not None})
    assert nchunks >= 2
    hold = tmp_path / "hold-last-chunk"
    monkeypatch.setenv("GPUSNAP_TEST_PAUSE_TRANSFER", f"{nchunks - 1}:{hold}")

    def release() -> None:
        deadline = time.monotonic() + 60
        while not hold.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not b.exists("swap")  # nothing is visible in B while chunks are still coming
        time.sleep(1.0)
        hold.unlink()

    t = threading.Thread(target=release)
    t.start()
    rep = gpu_restore(b, "swap", me, driver=cast(CudaDriver, d), features=FEATS, device=HostDevice(), thp_mode=None,
                      from_remote="r", jobs=1)
    t.join()
    assert all(d.get_state(p) == S.RUNNING for p in (me, child))
    assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before
    # the engine read its first chunk a second before the last one arrived: restore and pull overlapped
    assert rep.seconds["first_chunk_read"] + 0.9 < rep.seconds["all_local"], rep.seconds
    assert b.exists("swap") and ensure_local(b, "swap", "r") is None  # committed once all was local


def test_criu_restore_from_remote_with_the_split_fill(nodes: tuple[Node, Node]) -> None:
    """`criu restore --from` on an empty store with the split engaged: the runs the fill writes into
    the stopped tree come from the pull's arrivals (each verified on arrival), not from the store;
    the tree's memory checks out and the snapshot is whole locally afterwards."""
    require_criu()
    from support.criu import Tree, healthy
    a, b = nodes
    split_env = {"GPUSNAP_CRIU_IMAGES": "stream", "GPUSNAP_CRIU_SPLIT_MIN": str(8 << 20),
                 "GPUSNAP_CRIU_SPLIT_SHARED_MIN": str(8 << 20)}
    tree = Tree(mb=48)
    try:
        assert healthy(tree.report())
        a.json("criu", "dump", str(tree.pid), "big", env=split_env)
        tree.reap()
        a.json("push", "big")
        r = b.json("criu", "restore", "big", "--from", "r", env=split_env)
        served = r["stages"]["served"]
        assert served["moved_bytes"] >= 48 << 20 and served["split"]["written"] >= 48 << 20, served
        after = tree.report()
        assert healthy(after) and after["pid"] == tree.pid, after
        assert b.json("store", "verify")["ok"]
    finally:
        tree.kill()
