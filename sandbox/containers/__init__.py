"""Container runtimes (runc, Podman, CRI-O) and gpusnap: the CRIU hook's installation, runtime
checkpoint archives in the store, and telling a container's process from a host one."""
