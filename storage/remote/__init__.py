"""The remote tier: an object store that snapshots are pushed to and pulled or restored from."""
