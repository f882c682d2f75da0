"""gpusnap storage layer: where snapshot bytes go, fast and safe.

Knows nothing of CRIU, runsc or CUDA processes. It takes named byte streams (files, host buffers,
pipes, device regions) and gives them back, chunked, deduplicated, compressed and verified.
The on-disk format and its guarantees are in FORMAT.md beside this file.
"""
