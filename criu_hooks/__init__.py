"""gpusnap criu_hooks layer: what CRIU and OCI runtimes (runc, Podman) run on the host: the CRIU action
script. Thin: read env/args, call sandbox/."""
