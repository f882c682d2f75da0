"""Developer scripts (setup, benchmarks, GPU-machine runs, workloads), run as modules from the
repository root: `python3 -m scripts.bench.bench_store --help`."""
