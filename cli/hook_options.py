"""--prepare, --resume, --hook-timeout (and --no-resume on restores): the workload hooks of `criu dump|restore`
and `gpu checkpoint|restore` (sandbox.ops.hooks, sandbox.ops.prepared)."""
from __future__ import annotations

from typing import Any, Callable

import click

from sandbox.ops.hooks import DEFAULT_TIMEOUT_S, WorkloadHooks

STEP_HELP = ("an argv command line (run without a shell, clean environment, killed with its process group at "
             "the deadline) or an http:// URL on a loopback address that gpusnap POSTs to, e.g. vLLM's "
             "http://127.0.0.1:8000/sleep?level=1")


def hook_options(restore: bool) -> Callable[[Any], Any]:
    """The options, as a decorator; RESTORE adds --no-resume and says how a restore uses them."""
    def add(fn: Any) -> Any:
        fn = click.option("--hook-timeout", type=float, default=DEFAULT_TIMEOUT_S, show_default=True,
                          metavar="SECONDS", help="Deadline of each --prepare/--resume step.")(fn)
        if restore:
            fn = click.option("--no-resume", is_flag=True,
                              help="Run no resume step, not even the one the snapshot records.")(fn)
            fn = click.option("--resume", default=None, metavar="STEP",
                              help="Tell the restored workload to go on (default: the step the snapshot "
                                   "recorded, run only if this store's gpusnap recorded it); " + STEP_HELP)(fn)
            return click.option("--prepare", default=None, metavar="STEP",
                                help="Run before anything is restored (e.g. to make room); if it fails nothing "
                                     "is restored. " + STEP_HELP)(fn)
        fn = click.option("--resume", default=None, metavar="STEP",
                          help="Tell the workload to go on: after a failure, after --leave-running, and (recorded "
                               "in the snapshot) after its restore; " + STEP_HELP)(fn)
        return click.option("--prepare", default=None, metavar="STEP",
                            help="Tell the workload to prepare (drain requests, free what it can re-create) before "
                                 "its GPU is locked and its tree seized; if it fails or times out, no snapshot "
                                 "is taken and the workload is resumed. " + STEP_HELP)(fn)
    return add


def workload_hooks(prepare: str | None, resume: str | None, timeout_s: float,
                   no_resume: bool = False) -> WorkloadHooks:
    """The parsed steps (HookSpecError, exit 2, for a step gpusnap does not run)."""
    if no_resume and resume is not None:
        raise click.UsageError("--resume and --no-resume exclude each other")
    return WorkloadHooks.parse(prepare, resume, timeout_s)
