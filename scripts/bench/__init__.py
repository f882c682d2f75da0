"""Benchmarks: the store, CRIU, the GPU data path engine, end to end (run as `python3 -m scripts.bench.NAME`)."""
