"""Host-level settings and process plumbing: transparent huge pages, network namespaces, process groups,
signal handling, /proc process state."""
