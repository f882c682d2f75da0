"""gpusnap sandbox layer: what gets frozen and how (CUDA driver checkpoint API, CRIU, runsc, containers),
the operations that freeze a workload and their journal and recovery (ops/), and host-level settings
(host/: THP, network namespaces, process groups, signals). Depends on storage/, never the other way round."""
