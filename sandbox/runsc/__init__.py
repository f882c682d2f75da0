"""gVisor: the runsc runner, OCI bundles and sandbox snapshots."""
