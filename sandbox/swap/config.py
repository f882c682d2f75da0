"""The `gpusnap swap serve` configuration: a TOML file, read with tomllib and validated whole into frozen
dataclasses before anything starts. Every error is one line naming the key (ConfigError, exit 2).

    listen = "127.0.0.1:8080"        # optional: one shared port, routing by /NAME/... or JSON "model"
    metrics = "127.0.0.1:9100"       # optional: /metrics there too (always on the shared port)
    control = "/run/gpusnap/swap.sock"
    gpu_memory = 0.6                 # bytes (int or "40GiB"), or a fraction (0 < f <= 1) of the GPUs' memory
    max_resident = 1
    request_timeout = 120            # seconds a request may wait for its server (then 503 with the reason)
    start_timeout = 300              # seconds a server may take to answer its health path

    [[model]]
    name = "a"
    command = ["python3", "server.py", "9001"]   # an argv list: never run through a shell
    port = 9001                      # where the server listens, on 127.0.0.1
    listen = "127.0.0.1:8001"        # optional: gpusnap serves this model alone there
    health = "/health"
    mode = "criu"                    # or "gpu"
    pinned = false
    gpu_memory = "20GiB"             # optional: what it holds before it was ever measured
    cwd = "/srv/a"                   # optional
    env = { HF_HOME = "/srv/hf" }    # optional, added to gpusnap's environment
    prepare = ["/srv/a/drain"]       # optional workload hooks (see Model.prepare)
    resume = ["/srv/a/warm"]
"""
from __future__ import annotations

import enum
import ipaddress
import os
import re
import shlex
import stat
import tomllib
from dataclasses import dataclass, field
from typing import Any

from storage.api import EXIT_USAGE, GpusnapError

from sandbox.ops.hooks import WorkloadHooks

MAX_CONFIG_BYTES = 1 << 20
MAX_MODELS = 64
DEFAULT_CONTROL = "/run/gpusnap/swap.sock"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?", re.I)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ConfigError(GpusnapError):
    """The configuration file is not one `swap serve` can run (the message names the key)."""

    exit_code = EXIT_USAGE


class Mode(str, enum.Enum):
    GPU = "gpu"    # `gpu checkpoint`/`gpu restore` in place: the process stays, its GPU memory goes
    CRIU = "criu"  # `criu dump` into the store (the process goes) and `criu restore` on demand


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Budget:
    """GPU memory the resident servers may hold together: BYTES, or FRACTION of the GPUs' total (read
    through NVML when the daemon starts); neither: no memory budget (max_resident alone)."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, total_gpu_bytes: int | None) -> int | None:
        """The budget in bytes (None: none); a fraction needs the GPUs' total (ConfigError without it)."""
        if self.fraction is None:
            return self.bytes
        if not total_gpu_bytes:
            raise ConfigError(f"gpu_memory = {self.fraction:g} is a fraction of the GPU memory, and NVML reports "
                              "no GPU here: give it in bytes, or use max_resident")
        return int(total_gpu_bytes * self.fraction)


@dataclass(frozen=True)
class Model:
    """One server. PREPARE/RESUME: argv hooks (or one loopback http:// URL) run as the operations'
    --prepare/--resume, each within HOOK_TIMEOUT seconds (sandbox.swap.swapper)."""

    name: str
    command: tuple[str, ...]
    port: int
    health: str
    mode: Mode
    listen: Address | None = None
    pinned: bool = False
    gpu_memory: int | None = None
    cwd: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    prepare: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()
    hook_timeout: float = 60.0

    @property
    def snapshot(self) -> str:
        """The store snapshot that holds this server while it is swapped out."""
        return f"swap.{self.name}"


@dataclass(frozen=True)
class Config:
    models: tuple[Model, ...]
    listen: Address | None = None
    metrics: Address | None = None
    control: str = DEFAULT_CONTROL
    budget: Budget = field(default_factory=Budget)
    max_resident: int | None = None
    request_timeout: float = 120.0
    start_timeout: float = 300.0
    max_route_body: int = 1 << 20   # bytes read at most to find a JSON body's "model"

    def model(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def run_dir(self) -> str:
        """Where the daemon keeps its state file and the servers' logs: beside the control socket."""
        return os.path.dirname(self.control)


def _err(key: str, why: str) -> ConfigError:
    return ConfigError(f"config: {key}: {why}")


def parse_size(v: Any, key: str) -> int:
    if isinstance(v, bool):
        raise _err(key, "a size in bytes (an integer or a string such as \"40GiB\")")
    if isinstance(v, int):
        n = v
    elif isinstance(v, str) and (m := _SIZE_RE.fullmatch(v.strip())):
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise _err(key, f"{v!r} is not a size in bytes (an integer or a string such as \"40GiB\")")
    if n <= 0 or n > 1 << 50:
        raise _err(key, f"{v!r} is out of range")
    return n


def parse_budget(v: Any) -> Budget:
    if isinstance(v, float):
        if not 0 < v <= 1:
            raise _err("gpu_memory", f"a fraction must be in (0, 1], not {v:g}; bytes are an integer")
        return Budget(fraction=v)
    return Budget(bytes=parse_size(v, "gpu_memory"))


def parse_address(v: Any, key: str) -> Address:
    if not isinstance(v, str):
        raise _err(key, "an address HOST:PORT")
    host, sep, port = v.rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise _err(key, f"{v!r} is not HOST:PORT")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise _err(key, f"{host!r} is not an IP address") from None
    return Address(host, _port(port, key))


def _port(v: Any, key: str) -> int:
    try:
        n = int(v) if not isinstance(v, bool) and isinstance(v, (int, str)) else -1
    except ValueError:
        n = -1
    if not 1 <= n <= 65535:
        raise _err(key, f"{v!r} is not a port (1-65535)")
    return n


def _argv(v: Any, key: str, required: bool) -> tuple[str, ...]:
    if v is None and not required:
        return ()
    if isinstance(v, str):
        raise _err(key, "an argv list such as [\"python3\", \"server.py\"] (gpusnap never runs a shell)")
    if not isinstance(v, list) or not v or not all(isinstance(a, str) and a and "\0" not in a for a in v):
        raise _err(key, "a non-empty list of non-empty strings")
    return tuple(v)


def _number(v: Any, key: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v <= hi:
        raise _err(key, f"{v!r} is not a number of seconds in ({lo:g}, {hi:g}]")
    return float(v)


_MODEL_KEYS = {"name", "command", "port", "listen", "health", "mode", "pinned", "gpu_memory", "cwd", "env",
               "prepare", "resume", "hook_timeout"}
_TOP_KEYS = {"listen", "metrics", "control", "gpu_memory", "max_resident", "request_timeout", "start_timeout",
             "model"}


def _model(d: Any, i: int) -> Model:
    where = f"model[{i}]"
    if not isinstance(d, dict):
        raise _err(where, "a table")
    unknown = set(d) - _MODEL_KEYS
    if unknown:
        raise _err(f"{where}.{sorted(unknown)[0]}", "unknown key")
    name = d.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name == "metrics":
        raise _err(f"{where}.name", f"{name!r} is not a name (letters, digits, '_', '.', '-'; up to 63; not 'metrics')")
    where = f"model {name!r}"
    if "port" not in d:
        raise _err(f"{where}.port", "missing: the port the server listens on (127.0.0.1)")
    health = d.get("health", "/")
    if not isinstance(health, str) or not health.startswith("/") or any(c in health for c in " \r\n\t") \
            or len(health) > 1024:
        raise _err(f"{where}.health", f"{health!r} is not a URL path (starting with '/')")
    try:
        mode = Mode(d.get("mode", "gpu"))
    except ValueError:
        raise _err(f"{where}.mode", f"{d.get('mode')!r}: 'gpu' or 'criu'") from None
    pinned = d.get("pinned", False)
    if not isinstance(pinned, bool):
        raise _err(f"{where}.pinned", "true or false")
    cwd = d.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
        raise _err(f"{where}.cwd", "an absolute path")
    env = d.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                            and isinstance(v, str) and "\0" not in v for k, v in env.items()):
        raise _err(f"{where}.env", "a table of NAME = \"value\" strings")
    m = Model(name=name, command=_argv(d.get("command"), f"{where}.command", True),
              port=_port(d["port"], f"{where}.port"), health=health, mode=mode,
              listen=parse_address(d["listen"], f"{where}.listen") if "listen" in d else None, pinned=pinned,
              gpu_memory=parse_size(d["gpu_memory"], f"{where}.gpu_memory") if "gpu_memory" in d else None,
              cwd=cwd, env=tuple(sorted(env.items())), prepare=_argv(d.get("prepare"), f"{where}.prepare", False),
              resume=_argv(d.get("resume"), f"{where}.resume", False),
              hook_timeout=_number(d.get("hook_timeout", 60.0), f"{where}.hook_timeout", 0, 3600))
    try:  # the hooks checked as the commands check them
        workload_hooks(m)
    except GpusnapError as e:
        raise ConfigError(f"{where}.prepare/resume: {e}") from None
    return m


def workload_hooks(model: "Model") -> WorkloadHooks:
    """MODEL's prepare/resume hooks as the operations take them (an argv list, or one http:// URL)."""
    def spec(argv: tuple[str, ...]) -> str | None:
        if not argv:
            return None
        return argv[0] if len(argv) == 1 and argv[0].startswith("http://") else shlex.join(argv)
    return WorkloadHooks.parse(spec(model.prepare), spec(model.resume), model.hook_timeout)


def parse(d: dict[str, Any]) -> Config:
    """A Config from the TOML document D (ConfigError naming the first wrong key)."""
    unknown = set(d) - _TOP_KEYS
    if unknown:
        raise _err(sorted(unknown)[0], "unknown key (models go in [[model]] tables)")
    raw = d.get("model")
    if not isinstance(raw, list) or not raw:
        raise _err("model", "no [[model]] table: name at least one server")
    if len(raw) > MAX_MODELS:
        raise _err("model", f"{len(raw)} models; at most {MAX_MODELS}")
    models = tuple(_model(m, i) for i, m in enumerate(raw))
    names = [m.name for m in models]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise _err(f"model {dup!r}", "named twice")
    listen = parse_address(d["listen"], "listen") if "listen" in d else None
    metrics = parse_address(d["metrics"], "metrics") if "metrics" in d else None
    if listen is None and not any(m.listen for m in models):
        raise _err("listen", "nothing to serve: give the shared listen address or a model's own listen")
    ports = [("model " + repr(m.name) + ".port", m.port) for m in models]
    ports += [(f"model {m.name!r}.listen", m.listen.port) for m in models if m.listen]
    ports += [(k, a.port) for k, a in (("listen", listen), ("metrics", metrics)) if a]
    seen: dict[int, str] = {}
    for key, port in ports:
        if port in seen:
            raise _err(key, f"port {port} is also {seen[port]}")
        seen[port] = key
    control = d.get("control", DEFAULT_CONTROL)
    if not isinstance(control, str) or not os.path.isabs(control) or len(control) > 100:
        raise _err("control", "an absolute path of at most 100 characters (a unix socket)")
    mr = d.get("max_resident")
    if mr is not None and (isinstance(mr, bool) or not isinstance(mr, int) or mr < 1):
        raise _err("max_resident", f"{mr!r} is not a count >= 1")
    if mr is not None and mr < sum(m.pinned for m in models):
        raise _err("max_resident", f"{mr} is less than the {sum(m.pinned for m in models)} pinned models")
    return Config(models=models, listen=listen, metrics=metrics, control=control,
                  budget=parse_budget(d["gpu_memory"]) if "gpu_memory" in d else Budget(), max_resident=mr,
                  request_timeout=_number(d.get("request_timeout", 120.0), "request_timeout", 0, 86400),
                  start_timeout=_number(d.get("start_timeout", 300.0), "start_timeout", 0, 86400))


def load(path: str) -> Config:
    """The configuration at PATH (read bounded, without following a planted FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"config {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(f"config {path}: not a regular file")
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path}: over {MAX_CONFIG_BYTES} bytes")
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config {path}: not TOML: {e}") from None
    return parse(doc)
