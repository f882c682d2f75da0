"""GPU state: the CUDA driver's checkpoint API, CUDA process discovery, freeze/thaw, the pool daemon."""
