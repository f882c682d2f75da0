"""gpusnap's version, written here and nowhere else (pyproject.toml takes it from this module).

A constant, not importlib.metadata: looking the installed distribution up cost every command ~37 ms
with a cold page cache (the metadata modules and a scan of site-packages), 2% of a 1.4 GB
`store put` on the dev VM."""

VERSION = "0.1.0"
