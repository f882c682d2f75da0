"""`gpusnap swap serve|status`: one GPU serving more model servers than it holds at once."""
from __future__ import annotations

import os
from typing import Any

import click

from storage.api import UnavailableError

from cli.common import emit, json_option, one_line_errors, open_store
from sandbox.swap import config as swap_config
from sandbox.swap import control


@click.group()
def swap() -> None:
    """Front several model servers sharing a GPU; swap them out and in as requests come.

    \b
    The config (TOML) names each server: its command (an argv list, never a shell), the port it
    listens on, its health path, its mode ("gpu": `gpu checkpoint`/`gpu restore` in place; "criu":
    `criu dump` into the store, `criu restore` on demand) and whether it is pinned; and a budget:
    gpu_memory (bytes, or a fraction of the GPU memory) and/or max_resident. See docs/GUIDE.md,
    "Swapping models on demand", for every key.
    """


@swap.command("serve")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.pass_context
@one_line_errors
def serve_cmd(ctx: click.Context, config_path: str) -> None:
    """Run the swap daemon for CONFIG until SIGTERM or Ctrl-C.

    A request for a resident server is passed through as a stream (keep-alive, chunked, server-sent
    events unchanged). One for a swapped-out server waits while the least recently used idle,
    unpinned servers are swapped out (no more than the budget needs) and it is brought back; requests
    queue in arrival order; past request_timeout they get 503 with the reason. A server that dies is
    restarted (criu mode: from its last snapshot). Every swap is a journaled gpusnap operation: if the
    daemon is killed, `gpusnap recover` finishes what was in flight, and the next `swap serve` adopts
    the servers still running and the snapshots holding the others. On SIGTERM the servers it runs are
    stopped (their snapshots stay). One log line per swap on stderr. Needs root."""
    cfg = swap_config.load(config_path)
    if os.geteuid() != 0:
        raise UnavailableError("swap serve needs root: it checkpoints and restores processes (CRIU, the CUDA "
                               "driver) and its control socket is root-only (run it with sudo)")
    if any(m.mode == swap_config.Mode.CRIU for m in cfg.models):
        from sandbox.criu.runner import find_criu
        if not find_criu():
            raise UnavailableError("a model has mode = \"criu\" and no CRIU >= 4 is here (`gpusnap doctor`)")
    from sandbox.swap.daemon import serve
    serve(cfg, open_store(ctx))


def socket_options(fn: Any) -> Any:
    fn = click.option("--socket", "socket_path", default=None, metavar="PATH",
                      help="The daemon's control socket (default: CONFIG's `control`, else "
                           f"{swap_config.DEFAULT_CONTROL}).")(fn)
    return click.argument("config_path", metavar="[CONFIG]", required=False, type=click.Path(dir_okay=False))(fn)


def _socket(config_path: str | None, socket_path: str | None) -> str:
    return socket_path or (swap_config.load(config_path).control if config_path else swap_config.DEFAULT_CONTROL)


@swap.command("status")
@socket_options
@json_option
@one_line_errors
def status_cmd(config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """Who is resident, GPU memory each, requests in flight and queued, swaps and their durations
    (p50/p99 per server), from a running `swap serve` (its root-only control socket)."""
    st = control.ask(_socket(config_path, socket_path), {"op": "status"})
    emit(as_json, st, control.render(st))


@swap.command("stop")
@socket_options
@click.option("--timeout", "timeout_s", default=120.0, show_default=True, metavar="SECONDS",
              help="How long to wait for the daemon to finish a swap in progress and stop its servers.")
@one_line_errors
def stop_cmd(config_path: str | None, socket_path: str | None, timeout_s: float) -> None:
    """Stop a running `swap serve` as SIGTERM does: the swap in progress finishes, the servers it runs
    are stopped (their snapshots stay in the store); returns once it is gone."""
    import time
    path = _socket(config_path, socket_path)
    r = control.ask(path, {"op": "stop"})
    end = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{r['pid']}") and time.monotonic() < end:
        time.sleep(0.05)
    if os.path.exists(f"/proc/{r['pid']}"):
        raise control.ControlError(f"the daemon (pid {r['pid']}) did not stop within {timeout_s:g} s")
    click.echo(f"stopped (pid {r['pid']})")


COMMANDS = [swap]
