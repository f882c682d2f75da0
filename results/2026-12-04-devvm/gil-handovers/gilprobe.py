"""Decodes of one bf16 chunk (shuffle2-zstd, into a page-aligned buffer, verified) done in 2 s by a thread
beside a busy pure-Python thread, at Python's 5 ms switch interval: each time the decoder gives the GIL up
for a C call and wants it back it may wait for the busy thread's interval."""
import sys, threading, time
import numpy as np
sys.path.insert(0, ".")
from storage import codecs
from storage.chunkfile import ChunkHeader, full_check, raw_chunk_id
from storage.directio import AlignedBuffer
raw = (np.random.default_rng(1).standard_normal(1 << 21).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
pl = codecs.Shuffle2Codec().encode(memoryview(raw))
cid = raw_chunk_id(raw)
src, dst = AlignedBuffer(len(pl)), AlignedBuffer(len(raw))
src.view[:len(pl)] = pl
h = ChunkHeader("shuffle2-zstd", len(raw), len(pl), True)
k = 200
t0 = time.perf_counter()
for _ in range(k): full_check(h, src.view[:len(pl)], cid, dst.view)
alone = (time.perf_counter() - t0) / k
stop, n = threading.Event(), [0]
def dec():
    while not stop.is_set():
        full_check(h, src.view[:len(pl)], cid, dst.view); n[0] += 1
th = threading.Thread(target=dec); th.start()
t = time.perf_counter() + 3.0; c = 0
while time.perf_counter() < t: c += 1
stop.set(); th.join()
print(f"alone {alone*1e3:.2f} ms/decode; beside a busy thread {3.0/n[0]*1e3:.1f} ms/decode ({n[0]} in 3 s)")
