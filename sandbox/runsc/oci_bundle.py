"""OCI bundles for runsc: rootfs, mounts, env, process, the network namespace, GPU devices."""
from __future__ import annotations

import json
import os
import stat
from typing import Any, Sequence

from storage.api import GpusnapError

NVIDIA_CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


class BundleError(GpusnapError):
    """A bundle that cannot be written or read."""


def nvidia_devices(gpus: Sequence[int], dev_root: str = "/dev") -> list[dict[str, Any]]:
    """OCI linux.devices entries for GPUs GPUS (indices) and the driver's control nodes, read from the
    host's device nodes (type, major, minor), as nvproxy needs them in the spec."""
    names = [*NVIDIA_CONTROL, *(f"nvidia{i}" for i in gpus)]
    out = []
    for n in names:
        path = os.path.join(dev_root, n)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if n == "nvidia-uvm-tools":
                continue  # optional: not every driver install creates it
            raise BundleError(f"{path} does not exist: no NVIDIA driver here, or no GPU {n[6:]}") from None
        if not stat.S_ISCHR(st.st_mode):
            raise BundleError(f"{path} is not a character device")
        out.append({"path": f"/dev/{n}", "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
                    "fileMode": 0o666, "uid": 0, "gid": 0})
    return out


def add_gpus(cfg: dict[str, Any], gpus: Sequence[int], *, dev_root: str = "/dev",
             capabilities: Sequence[str] = ("compute", "utility")) -> None:
    """Give the spec CFG GPUs GPUS: the device nodes, cgroup rules allowing them, and the NVIDIA env."""
    devs = nvidia_devices(gpus, dev_root)
    lin = cfg.setdefault("linux", {})
    keep = [d for d in lin.get("devices", []) if not str(d.get("path", "")).startswith("/dev/nvidia")]
    lin["devices"] = keep + devs
    rules = [r for r in lin.setdefault("resources", {}).get("devices", []) if r.get("major") not in {d["major"] for d in devs}]
    rules += [{"allow": True, "type": "c", "major": d["major"], "minor": d["minor"], "access": "rwm"} for d in devs]
    lin["resources"]["devices"] = rules
    proc = cfg.setdefault("process", {})
    env = [e for e in proc.get("env", []) if not e.startswith(("NVIDIA_VISIBLE_DEVICES=", "NVIDIA_DRIVER_CAPABILITIES="))]
    env += [f"NVIDIA_VISIBLE_DEVICES={','.join(map(str, gpus))}", f"NVIDIA_DRIVER_CAPABILITIES={','.join(capabilities)}"]
    proc["env"] = env


def bundle_gpus(bundle: str) -> list[str]:
    """The NVIDIA device nodes a bundle's spec gives the sandbox (empty: not a GPU sandbox)."""
    cfg = load_spec(bundle)
    return [d["path"] for d in cfg.get("linux", {}).get("devices", []) if str(d.get("path", "")).startswith("/dev/nvidia")]


def load_spec(bundle: str) -> dict[str, Any]:
    try:
        with open(os.path.join(bundle, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BundleError(f"{bundle}: unreadable config.json: {e}") from None


def save_spec(bundle: str, cfg: dict[str, Any]) -> None:
    path = os.path.join(bundle, "config.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, path)


def add_bind(cfg: dict[str, Any], source: str, destination: str, *, readonly: bool = False) -> None:
    """Bind-mount host SOURCE at DESTINATION inside the sandbox (e.g. the store, for the GPU agent)."""
    mounts = [m for m in cfg.setdefault("mounts", []) if m.get("destination") != destination]
    mounts.append({"destination": destination, "type": "bind", "source": os.path.abspath(source),
                   "options": ["rbind", "ro" if readonly else "rw"]})
    cfg["mounts"] = mounts


def build_bundle(directory: str, argv: Sequence[str], *, rootfs: str = "/", readonly: bool = True,
                 env: dict[str, str] | None = None, netns_path: str | None = None, tmpfs: Sequence[str] = ("/tmp",),
                 cwd: str = "/", gpus: Sequence[int] = (), dev_root: str = "/dev") -> str:
    """Write DIRECTORY/config.json running ARGV in ROOTFS (the host / read-only by default); with GPUS,
    the NVIDIA device nodes and env for nvproxy (runsc then needs the flags of RunscFeatures.gpu_args)."""
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
    if gpus:
        add_gpus(config, gpus, dev_root=dev_root)
    save_spec(directory, config)
    return directory


def bundle_netns(bundle: str) -> str | None:
    """The network namespace path a bundle joins, if any."""
    cfg = load_spec(bundle)
    for ns in cfg.get("linux", {}).get("namespaces", []):
        if ns.get("type") == "network":
            return ns.get("path")
    return None


def set_bundle_netns(bundle: str, path: str | None) -> None:
    """Make BUNDLE join the network namespace at PATH (None: a new, empty one). runsc takes the
    namespace from the spec; started inside a namespace by setns instead, this runsc's sandbox
    stopped within a second here (seen 2026-11-29), so the spec is the way."""
    cfg = load_spec(bundle)
    spaces = [ns for ns in cfg.setdefault("linux", {}).setdefault("namespaces", []) if ns.get("type") != "network"]
    spaces.append({"type": "network", **({"path": path} if path else {})})
    cfg["linux"]["namespaces"] = spaces
    save_spec(bundle, cfg)
