"""gpusnap criu_hooks layer: entry points that CRIU, OCI runtimes and sandboxes run. Thin: read env/args, call sandbox/."""
