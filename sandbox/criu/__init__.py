"""CRIU: the runner of the criu binary and process-tree snapshots through it."""
