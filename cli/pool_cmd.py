"""`gpusnap pool serve|ls|usage|rm|stop`: the memory tier's resident process (sandbox/gpu/pool_daemon.py)."""
from __future__ import annotations

import os
import signal

import click


from cli.common import emit, human, json_option, one_line_errors, parse_size
from sandbox.gpu.pool_daemon import DEFAULT_SOCKET, PoolServer, request


socket_option = click.option("--socket", "socket_path", default=os.environ.get("GPUSNAP_POOL_SOCKET", DEFAULT_SOCKET),
                             show_default=True, metavar="PATH", help="The pool daemon's socket (env GPUSNAP_POOL_SOCKET).")


@click.group()
def pool() -> None:
    """The memory tier: a resident pool of pinned host memory for swapping GPU state out and in."""


@pool.command("serve")
@click.option("--size", required=True, help="Pinned host memory to hold, e.g. 64G (taken once, at start).")
@socket_option
@one_line_errors
def pool_serve(size: str, socket_path: str) -> None:
    """Hold the pool and serve swap requests until stopped (SIGTERM, Ctrl-C or `gpusnap pool stop`).

    Needs the driver's custom-storage API; `gpusnap gpu checkpoint PID NAME --tier memory` and
    `gpusnap gpu restore NAME PID --tier memory` talk to it."""
    with PoolServer(socket_path, parse_size(size)) as srv:
        signal.signal(signal.SIGTERM, lambda *_: srv.op_stop({}))
        click.echo(f"pool: {human(srv.pool.capacity)} pinned in {srv.pool_seconds:.1f} s, serving {socket_path} "
                   f"(GPU path: {srv.features.path})", err=True)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass


@pool.command("ls")
@socket_option
@json_option
@one_line_errors
def pool_ls(socket_path: str, as_json: bool) -> None:
    """Snapshots in the pool."""
    snaps = request(socket_path, {"op": "ls"})["snapshots"]
    emit(as_json, snaps, "\n".join(f"{s['name']}  pids {s.get('pids')}  {human(s.get('stored_bytes', 0))} held"
                                   f"{'  (swapped out)' if s.get('swapped_out') else ''}" for s in snaps) or "(empty)")


@pool.command("usage")
@socket_option
@json_option
@one_line_errors
def pool_usage(socket_path: str, as_json: bool) -> None:
    """How full the pool is."""
    u = request(socket_path, {"op": "usage"})
    emit(as_json, u, f"{human(u['usage']['used'])} of {human(u['usage']['capacity'])} used, "
         f"{u['usage']['snapshots']} snapshot(s), {u['usage']['chunks']} chunk(s); GPU path {u['path']}")


@pool.command("rm")
@click.argument("name")
@socket_option
@one_line_errors
def pool_rm(name: str, socket_path: str) -> None:
    """Drop snapshot NAME from the pool (refused while its processes are swapped out)."""
    request(socket_path, {"op": "rm", "name": name})


@pool.command("stop")
@socket_option
@one_line_errors
def pool_stop(socket_path: str) -> None:
    """Stop the daemon (the pool's contents are gone with it)."""
    request(socket_path, {"op": "stop"})


COMMANDS = [pool]
