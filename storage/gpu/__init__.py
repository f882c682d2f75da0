"""A CUDA device as the storage layer sees it: pinned buffers, streams, nvCOMP."""
