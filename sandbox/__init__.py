"""gpusnap sandbox layer: what gets frozen and how (CUDA driver checkpoint API, CRIU, runsc,
network namespaces) and the `gpusnap` CLI. Depends on storage/, never the other way round."""
