"""`python -m cli`: the same as the `gpusnap` command."""
from cli import main

main()
