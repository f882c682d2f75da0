"""The size limits on everything gpusnap reads from a store, an archive or a remote, in one place.

Guarantees kept here: every length a manifest, a chunk header, an archive member or a remote object
claims is checked against one of these before a buffer is sized from it, so no input can make
gpusnap allocate more than the format allows (FORMAT.md, "Limits" lists them with their reasons).
"""
from __future__ import annotations

# A chunk's raw (decoded) length, for every kind of chunk: the largest chunk size `put` accepts
# (the GPU path cuts 64 MiB chunks by default and refuses chunk sizes above this).
MAX_RAW_CHUNK = 1 << 30
# A chunk's stored length: at most its raw length on the host path; the GPU codecs may expand
# incompressible data slightly (the engine's output buffer is 1.5 x the chunk + 4 MiB).
MAX_STORED_CHUNK = MAX_RAW_CHUNK + MAX_RAW_CHUNK // 2 + (4 << 20)
# A manifest (snapshots/NAME.json, an archive's manifest.json, a remote's snapshots/NAME.json):
# about 200 bytes a chunk reference, so 256 MiB holds a snapshot of ~1.3 M chunks (~80 TB at 64 MiB).
MAX_MANIFEST = 256 << 20
# The small JSON records: an archive's header, a remote's marker (gpusnap-remote.json), a lock object.
MAX_RECORD = 64 << 10
# A remote's chunk index object (one 64-digit id and a newline per chunk): 16 M chunks.
MAX_REMOTE_INDEX = 16_000_000 * 65
# Requests to a remote in flight at once (--jobs), unless told otherwise.
DEFAULT_JOBS = 8
