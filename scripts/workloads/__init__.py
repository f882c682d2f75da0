"""Workloads that tests, benchmarks and the demo checkpoint: a GPU memory workload and its driver, a counter."""
