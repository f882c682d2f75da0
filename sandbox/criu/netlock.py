"""CRIU's network lock: while a tree with established TCP connections (`--tcp-established`) is dumped
and restored, CRIU blocks their packets so that no peer sees a reset. By default it does so with
iptables (it runs iptables-restore and ip6tables-restore); `--network-lock nftables` uses the
nftables library linked into CRIU instead; `--network-lock skip` takes no lock at all, for a caller
who knows the peers send nothing meanwhile (else a peer's packet can meet a closed socket and reset
the connection). On a machine with neither, CRIU used to fail with only "exited, status=127": here
the cause and the choices are said before anything is frozen, and `gpusnap doctor` says it beforehand.
"""
from __future__ import annotations

import shutil
from typing import Any

from storage.api import UnavailableError

METHODS = ("iptables", "nftables", "skip")
IPTABLES_TOOLS = ("iptables-restore", "ip6tables-restore")


def missing_tools(method: str | None) -> list[str]:
    """The programs CRIU runs for METHOD (None: CRIU's default, iptables) that are not on PATH."""
    if (method or "iptables") != "iptables":
        return []
    return [t for t in IPTABLES_TOOLS if shutil.which(t) is None]


def nftables_built_in(binary: str | None) -> bool | None:
    """Whether the CRIU at BINARY links the nftables library (None: it cannot be read)."""
    if not binary:
        return None
    try:
        with open(binary, "rb") as f:
            return b"libnftables.so" in f.read(64 << 20)
    except OSError:
        return None


def problem(method: str | None, binary: str | None = None) -> str | None:
    """Why CRIU's network lock by METHOD cannot work here, with the choices; None when it can."""
    gone = missing_tools(method)
    if not gone:
        return None
    nft = nftables_built_in(binary)
    return (f"CRIU's network lock (it holds the connections' packets while the tree is dumped and restored) runs "
            f"{' and '.join(gone)}, which this machine lacks: install iptables, or pass --network-lock nftables"
            + (" (this CRIU is built with nftables)" if nft else
               " (this CRIU is built without nftables: it would fail)" if nft is False else "")
            + ", or --network-lock skip (no lock: only where the peers send nothing meanwhile)")


def require(what: str, method: str | None, binary: str | None = None) -> None:
    """Refuse WHAT (exit 4: the machine lacks a program) where the network lock by METHOD cannot work."""
    why = problem(method, binary)
    if why is not None:
        raise UnavailableError(f"{what} --tcp-established: {why}")


def describe(binary: str | None) -> dict[str, Any]:
    """For `gpusnap doctor`: what each method needs here."""
    return {"iptables_missing": missing_tools("iptables"), "nftables_built_in": nftables_built_in(binary),
            "problem": problem(None, binary)}


def method_of(options: "tuple[str, ...] | list[str]") -> str | None:
    """The --network-lock METHOD recorded in a snapshot's CRIU options (None: CRIU's default); a value
    not among METHODS is not gpusnap's and is ignored."""
    opts = list(options)
    for i, o in enumerate(opts[:-1]):
        if o == "--network-lock" and opts[i + 1] in METHODS:
            return opts[i + 1]
    return None
