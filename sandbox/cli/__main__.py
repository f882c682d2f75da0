"""`python -m sandbox.cli`: the same as the `gpusnap` command."""
from sandbox.cli import main

main()
