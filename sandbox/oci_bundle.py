"""OCI bundles for runsc: rootfs, mounts, env, process, the network namespace."""
from __future__ import annotations

import json
import os
from typing import Any, Sequence


class BundleError(Exception):
    """A bundle that cannot be written or read."""


def build_bundle(directory: str, argv: Sequence[str], *, rootfs: str = "/", readonly: bool = True,
                 env: dict[str, str] | None = None, netns_path: str | None = None, tmpfs: Sequence[str] = ("/tmp",),
                 cwd: str = "/") -> str:
    """Write DIRECTORY/config.json running ARGV in ROOTFS (the host / read-only by default)."""
    if not argv:
        raise BundleError("a bundle needs a command to run")
    os.makedirs(directory, exist_ok=True)
    e = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **(env or {})}
    namespaces: list[dict[str, Any]] = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    namespaces.append({"type": "network", **({"path": netns_path} if netns_path else {})})
    config = {
        "ociVersion": "1.0.0",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": list(argv), "cwd": cwd,
                    "env": [f"{k}={v}" for k, v in e.items()],
                    "capabilities": {k: ["CAP_NET_BIND_SERVICE", "CAP_KILL", "CAP_AUDIT_WRITE"]
                                     for k in ("bounding", "effective", "inheritable", "permitted")},
                    "noNewPrivileges": True},
        "root": {"path": os.path.abspath(rootfs), "readonly": readonly},
        "hostname": "gpusnap",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                   *({"destination": d, "type": "tmpfs", "source": "tmpfs"} for d in tmpfs)],
        "linux": {"namespaces": namespaces},
    }
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return directory


def bundle_netns(bundle: str) -> str | None:
    """The network namespace path a bundle joins, if any."""
    try:
        with open(os.path.join(bundle, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise BundleError(f"{bundle}: unreadable config.json: {e}") from None
    for ns in cfg.get("linux", {}).get("namespaces", []):
        if ns.get("type") == "network":
            return ns.get("path")
    return None


def set_bundle_netns(bundle: str, path: str | None) -> None:
    """Make BUNDLE join the network namespace at PATH (None: a new, empty one). runsc takes the
    namespace from the spec; started inside a namespace by setns instead, this runsc's sandbox
    stopped within a second here (seen 2026-11-29), so the spec is the way."""
    cfg_path = os.path.join(bundle, "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise BundleError(f"{bundle}: unreadable config.json: {e}") from None
    spaces = [ns for ns in cfg.setdefault("linux", {}).setdefault("namespaces", []) if ns.get("type") != "network"]
    spaces.append({"type": "network", **({"path": path} if path else {})})
    cfg["linux"]["namespaces"] = spaces
    tmp = cfg_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, cfg_path)
