"""`python -m cli`: the same as the `gpusnap` command."""
from cli import main

try:
    main()
except BrokenPipeError:  # output outside a command (--help | head): quiet, as for SIGPIPE
    from cli.common import quiet_broken_pipe
    quiet_broken_pipe()
