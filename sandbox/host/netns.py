"""A network namespace per sandbox, made with pyroute2: veth pair, addresses, default route.

The configuration is a small record (NetConfig) that is saved in a snapshot and recreated from it on
restore, so the sandbox answers at the same address. `network()` is the context manager that owns it:
whatever it created is removed on exit, also when creation failed halfway.

A NetConfig is validated whenever one is made (also from a snapshot, which may come from another
node): the namespace is named `gpusnap-...`, the veth ends `gs-...`/`gp-...` (so create and remove
can only ever touch links gpusnap names), and the two addresses are distinct hosts of one private
IPv4 subnet (so a snapshot cannot route public addresses into a sandbox).
"""
from __future__ import annotations

import ipaddress
import os
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator



from storage.api import GpusnapError

class NetnsError(GpusnapError):
    """A namespace or link that cannot be created, found or removed."""


def _pr2() -> Any:
    """pyroute2, imported when a sandbox network is used (the rest of gpusnap runs without it)."""
    try:
        import pyroute2  # noqa: PLC0415
    except ImportError as e:
        raise NetnsError(f"sandbox networks need pyroute2 ({e}); install gpusnap's dependencies") from None
    return pyroute2


NETNS_DIR = "/var/run/netns"  # where pyroute2 (and so gpusnap) keeps named namespaces
_NETNS_RE = re.compile(r"gpusnap-[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,55}")
_HOST_IF_RE = re.compile(r"gs-[A-Za-z0-9_.+=@-]{1,12}")
_PEER_IF_RE = re.compile(r"gp-[A-Za-z0-9_.+=@-]{1,12}")


@dataclass(frozen=True)
class NetConfig:
    name: str
    host_if: str
    peer_if: str
    host_cidr: str   # e.g. 10.77.0.1/24, on the host side of the veth
    ns_cidr: str     # e.g. 10.77.0.2/24, inside the namespace; the default route points at host_cidr's address

    def __post_init__(self) -> None:
        for what, v, pattern in (("namespace name", self.name, _NETNS_RE),
                                 ("host interface", self.host_if, _HOST_IF_RE),
                                 ("sandbox interface", self.peer_if, _PEER_IF_RE)):
            if not (isinstance(v, str) and pattern.fullmatch(v)):
                raise NetnsError(f"network {what} {v!r} is not one gpusnap makes ({pattern.pattern})")
        try:
            host, inner = ipaddress.IPv4Interface(self.host_cidr), ipaddress.IPv4Interface(self.ns_cidr)
        except (ipaddress.AddressValueError, ipaddress.NetmaskValueError, TypeError, ValueError) as e:
            raise NetnsError(f"network addresses {self.host_cidr!r}, {self.ns_cidr!r}: {e}") from None
        net = host.network
        if not 8 <= net.prefixlen <= 30 or inner.network != net or host.ip == inner.ip:
            raise NetnsError(f"network addresses {self.host_cidr}, {self.ns_cidr}: expected two distinct hosts of "
                             "one subnet between /8 and /30")
        if not net.is_private or net.is_loopback or net.is_link_local or net.is_multicast or \
                any(a in (net.network_address, net.broadcast_address) for a in (host.ip, inner.ip)):
            raise NetnsError(f"network {net}: a sandbox subnet must be private (RFC 1918) and its two hosts "
                             "neither the network nor the broadcast address")

    @property
    def path(self) -> str:
        return os.path.join(NETNS_DIR, self.name)

    @property
    def address(self) -> str:
        return str(ipaddress.ip_interface(self.ns_cidr).ip)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NetConfig":
        keys = ("name", "host_if", "peer_if", "host_cidr", "ns_cidr")
        if not isinstance(d, dict) or set(d) != set(keys):
            raise NetnsError(f"a network record has exactly the fields {', '.join(keys)}")
        return cls(**{k: d[k] for k in keys})

    @classmethod
    def for_sandbox(cls, name: str, subnet: str) -> "NetConfig":
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as e:
            raise NetnsError(f"--net-subnet {subnet!r}: {e}") from None
        if net.prefixlen > 30:
            raise NetnsError(f"--net-subnet {subnet}: too small for two hosts")
        hosts = [net.network_address + 1, net.network_address + 2]
        tag = name[-8:]
        return cls(name, f"gs-{tag}"[:15], f"gp-{tag}"[:15], f"{hosts[0]}/{net.prefixlen}",
                   f"{hosts[1]}/{net.prefixlen}")


def exists(cfg: NetConfig) -> bool:
    return cfg.name in _pr2().netns.listnetns()


def create(cfg: NetConfig) -> None:
    """Create the namespace, the veth pair, addresses, links up and the default route."""
    if exists(cfg):
        raise NetnsError(f"network namespace {cfg.name!r} already exists")
    host = ipaddress.ip_interface(cfg.host_cidr)
    inner = ipaddress.ip_interface(cfg.ns_cidr)
    with _pr2().IPRoute() as ip:
        for a in ip.get_addr(family=2):
            addr = ipaddress.ip_address(a.get_attr("IFA_ADDRESS"))
            if addr in host.network:
                raise NetnsError(f"subnet {host.network} is already in use here ({addr} on interface "
                                 f"{a['index']}); choose another --net-subnet")
    try:
        _pr2().netns.create(cfg.name)
        with _pr2().IPRoute() as ip:
            ip.link("add", ifname=cfg.host_if, kind="veth", peer=cfg.peer_if)
            peer = ip.link_lookup(ifname=cfg.peer_if)[0]
            ip.link("set", index=peer, net_ns_fd=cfg.name)
            hidx = ip.link_lookup(ifname=cfg.host_if)[0]
            ip.addr("add", index=hidx, address=str(host.ip), prefixlen=host.network.prefixlen)
            ip.link("set", index=hidx, state="up")
        with _pr2().NetNS(cfg.name) as ns:
            lo = ns.link_lookup(ifname="lo")[0]
            ns.link("set", index=lo, state="up")
            pidx = ns.link_lookup(ifname=cfg.peer_if)[0]
            ns.addr("add", index=pidx, address=str(inner.ip), prefixlen=inner.network.prefixlen)
            ns.link("set", index=pidx, state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=str(host.ip))
    except Exception as e:  # noqa: BLE001 - undo what was made, then one clear error
        remove(cfg)
        raise NetnsError(f"cannot create network {cfg.name!r}: {e}") from None


def remove(cfg: NetConfig) -> None:
    """Remove the veth pair and the namespace; absent pieces are fine."""
    with _pr2().IPRoute() as ip:
        for idx in ip.link_lookup(ifname=cfg.host_if):
            ip.link("del", index=idx)
    if exists(cfg):
        _pr2().netns.remove(cfg.name)


def leftovers(cfg: NetConfig) -> list[str]:
    """What of CFG still exists (tests: nothing may be left behind)."""
    out = []
    if exists(cfg):
        out.append(f"netns {cfg.name}")
    with _pr2().IPRoute() as ip:
        if ip.link_lookup(ifname=cfg.host_if):
            out.append(f"link {cfg.host_if}")
    return out


@contextmanager
def network(cfg: NetConfig) -> Iterator[NetConfig]:
    create(cfg)
    try:
        yield cfg
    finally:
        remove(cfg)


def enter(name: str) -> None:
    """Move the calling process into namespace NAME (a subprocess preexec_fn: runsc then runs there)."""
    _pr2().netns.setns(name)
