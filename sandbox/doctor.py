"""What this machine can do for gpusnap: driver and checkpoint API, custom storage, GPUs, nvCOMP,
huge pages, NUMA, CRIU and runsc. Never fails: what is missing is reported as missing."""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict
from typing import Any

from storage.api import numa_nodes
from storage.api import EncodeProcsError, encode_procs

from sandbox.criu.protocol import CRIU_PAGE_PIPE, pipe_limits
from sandbox.criu.runner import cuda_plugin
from sandbox.gpu.driver import nvidia_driver_version, probe
from sandbox.host.hugepages import HugePagesError, free_page_reporting, hugetlb_pages, policy, thp_mode

PIPE_MAX_ADVISED = 64 << 20  # the fs.pipe-max-size doctor advises where the limit caps CRIU's page pipes


def _version(argv: list[str], pattern: str) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(pattern, out.stdout + out.stderr)
    return m.group(1) if m else None


def _nvcomp() -> str | None:
    try:
        from nvidia import nvcomp  # noqa: PLC0415
        return str(nvcomp.__version__)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None


def nvcomp_missing() -> str | None:
    """What exactly keeps nvCOMP from loading, in words naming the wheel to install; None when it loads.
    Two wheels make it: nvidia-nvcomp-cu13 (the Python package) and nvidia-libnvcomp-cu13 (libnvcomp.so.6,
    which pip installs as its dependency, but not with --no-deps or a copied site-packages)."""
    import importlib.util  # noqa: PLC0415
    try:
        if importlib.util.find_spec("nvidia.nvcomp") is None:
            raise ModuleNotFoundError
    except (ModuleNotFoundError, ValueError):
        return "the Python package is missing: install nvidia-nvcomp-cu13 (pip install -e '.[gpu]')"
    try:
        from nvidia import nvcomp  # noqa: PLC0415, F401
    except Exception as e:  # noqa: BLE001 - reported, never raised
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "libnvcomp" in first:
            return (f"the package nvidia-nvcomp-cu13 is installed but its library is not ({first}): "
                    "install nvidia-libnvcomp-cu13")
        return f"nvidia-nvcomp-cu13 does not load: {first}"
    return None


def criu_choice() -> dict[str, Any]:
    """Which CRIU binary gpusnap uses, why (GPUSNAP_CRIU, PATH, the project's build), and what it passed over."""
    from sandbox.criu.runner import locate_criu  # noqa: PLC0415
    c = locate_criu()
    return {"path": c.path, "why": c.why, "passed_over": list(c.passed_over),
            "version": ".".join(map(str, c.version)) if c.version else None,
            "known_failures": list(c.known_failures)}


def criu_network_lock() -> dict[str, Any]:
    """Whether CRIU's network lock (`criu dump --tcp-established`) can work here, and by which method."""
    from sandbox.criu import netlock  # noqa: PLC0415
    from sandbox.criu.runner import locate_criu  # noqa: PLC0415
    return netlock.describe(locate_criu().path)


def render_network_lock(n: dict[str, Any]) -> str:
    nft = {True: "built into this CRIU", False: "not built into this CRIU", None: "unknown"}[n["nftables_built_in"]]
    if n["problem"] is None:
        return f"TCP network lock     iptables (CRIU's default); nftables {nft}"
    return (f"TCP network lock     none by default (nftables {nft})\n  warning: criu dump --tcp-established: "
            f"{n['problem']}")


def runtime_criu_failures() -> list[str]:
    """What the `criu` runc and Podman run (the first on PATH) is known to fail at on this kernel."""
    from sandbox.criu.runner import criu_version, known_failures  # noqa: PLC0415
    found = shutil.which("criu")
    v = criu_version(found) if found else None
    return [f"{found}: {f}" for f in known_failures(v)] if v else []


def _runsc_features(runsc: str) -> dict[str, Any] | None:
    if not shutil.which(runsc):
        return None
    try:
        from sandbox.runsc.runner import Runsc  # noqa: PLC0415
        f = Runsc(binary=shutil.which(runsc)).features()
    except Exception:  # noqa: BLE001 - reported as unknown
        return None
    return {"nvproxy": f.nvproxy, "uncompressed_checkpoint": f.can_store_uncompressed,
            "save_restore_exec": f.save_restore_exec, "platforms": list(f.platforms)}


def gpu_handler(libdir: str | None = None) -> str:
    """Who checkpoints the GPU processes of the CRIU dumps runc, Podman or a plain `criu` make."""
    plugin = cuda_plugin(libdir)
    if plugin is not None:
        return f"CRIU's cuda plugin ({plugin}); gpusnap-criu-hook steps aside where it is installed"
    return ("gpusnap-criu-hook where it is installed as CRIU's action script (no CRIU cuda plugin); "
            "`gpusnap criu dump` handles GPUs itself")


def _container_hook() -> dict[str, Any]:
    """The CRIU hook for container runtimes: installed or not, which criu runc/Podman and gpusnap run."""
    try:
        from sandbox.containers.hook_install import status  # noqa: PLC0415
        s = status()
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        return {"installed": False, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}
    return {"installed": s["installed"], "hook": s["hook"], "criu_for_runtimes": s["criu_on_path"],
            "criu_for_gpusnap": s["criu_for_gpusnap"], "problems": s["problems"]}


def _render_container_hook(h: dict[str, Any]) -> list[str]:
    if "error" in h:
        return [f"container hook       unknown ({h['error']})"]
    lines = [f"container hook       {'installed: ' + h['hook'] if h['installed'] else 'not installed (gpusnap hook install)'}",
             f"criu for runtimes    runc/Podman run {h['criu_for_runtimes']}"]
    return lines + [f"  problem: {p}" for p in h["problems"]]


def _encoders() -> int | str:
    """How many encoder processes a dump would use here, or what is wrong with the setting."""
    try:
        return encode_procs()
    except EncodeProcsError as e:
        return str(e)


def _thp_policy() -> str:
    """What gpusnap does with THP for the driver's copies and restores here, or what is wrong with the setting."""
    try:
        return policy()
    except HugePagesError as e:
        return str(e)


def report(criu: str = "criu", runsc: str = "runsc") -> dict[str, Any]:
    f = probe()
    gpus = [asdict(g) for g in f.gpus]
    return {
        "gpu_path": f.path,
        "nvidia_kernel_driver": nvidia_driver_version(),
        "cuda_driver_api": f.driver_version,
        "cuda_bindings": f.bindings,
        "checkpoint_api": f.checkpoint_api,
        "custom_storage": f.custom_storage,
        "gpus": gpus,
        "decompression_engine": any(g["decompression_engine"] for g in gpus),
        "nvcomp": _nvcomp(),
        "nvcomp_missing": nvcomp_missing(),
        "transparent_hugepages": thp_mode(),
        "thp_policy": _thp_policy(),
        "free_page_reporting_order": free_page_reporting(),
        "hugetlb": hugetlb_pages(),
        "numa_nodes": numa_nodes(),
        "criu": _version([criu, "--version"], r"Version:\s*(\S+)"),
        "criu_gpu_handler": gpu_handler(),
        "criu_binary": criu_choice(),
        "criu_network_lock": criu_network_lock(),
        "criu_for_runtimes_known_failures": runtime_criu_failures(),
        "runsc": _version([runsc, "--version"], r"runsc version\s*(\S+)"),
        "runsc_features": _runsc_features(runsc),
        "container_hook": _container_hook(),
        "memory_tier": f.custom_storage,
        "dump_encoders": _encoders(),
        "pipes": pipe_limits(),
        "host_codec": _host_codec(),
        "dump_writes": _dump_writes(),
        "why_no_gpu": f.reason,
    }


def _host_codec() -> dict[str, Any]:
    """What the CPU codecs run on: the system's libzstd or python-zstandard, the byte planes in C or numpy;
    and how the dump reads CRIU's pipes (storage.fs.fdread: C, or Python's loop)."""
    from storage.api import delta
    from storage.api import shufflelib
    from storage.api import zstdlib
    from storage.api import fdread
    try:
        reads = fdread.describe()
    except fdread.FdReadError as e:
        reads = f"nothing: {e}"
    return {"libzstd": zstdlib.available(), "byte_planes": "C" if shufflelib.available() else "numpy",
            "page_counts": "C" if delta.native_page_counts() else "numpy", "pipe_reads": reads}


def _dump_writes() -> str:
    """How a dump writes its packs on this host (sandbox.host.dumpwrites), or why it cannot."""
    from sandbox.host import dumpwrites
    from storage.api import SettingError
    try:
        return dumpwrites.describe()
    except SettingError as e:
        return f"{e} (every dump refuses to start)"


def render_criu_binary(c: dict[str, Any]) -> str:
    line = (f"CRIU binary          {c['path']} (chosen: {c['why']})" if c["path"] else
            "CRIU binary          none usable (run scripts/setup.sh, or set GPUSNAP_CRIU to a CRIU >= 4)")
    line += "".join(f"\n                     passed over {p}" for p in c["passed_over"])
    return line + "".join(f"\n  warning: {f}" for f in c.get("known_failures", []))


def _render_pipes(p: dict[str, Any]) -> str:
    mib = lambda n: f"{n / 2**20:.3g} MiB"  # noqa: E731
    if not isinstance(p["dump_pipe"], int):
        return f"dump pipes           {p['dump_pipe']}"
    limit = ("no limit for this process (CAP_SYS_RESOURCE)" if p["cap_sys_resource"] else
             f"fs.pipe-max-size {mib(p['pipe_max_size'])}" if p["pipe_max_size"] else "fs.pipe-max-size unknown")
    line = (f"dump pipes           {mib(p['dump_pipe_allowed'] or p['dump_pipe'])} of the {mib(p['dump_pipe'])} asked "
            f"(GPUSNAP_DUMP_PIPE), CRIU's page pipes {mib(p['criu_page_pipe'])} of {mib(CRIU_PAGE_PIPE)}; {limit}")
    if p["criu_page_pipe"] < CRIU_PAGE_PIPE:
        line += ("\n  note: the limit slows CRIU's page dump (where measured it took 4% longer at 1 MiB than at 64 MiB "
                 f"on 16 cores, 14% on 2); as a host setting, `sysctl -w fs.pipe-max-size={PIPE_MAX_ADVISED}` (kept in "
                 "/etc/sysctl.d/) lets every user's pipes grow that far; each user's pipe memory stays bounded by "
                 "fs.pipe-user-pages-soft")
    return line


def render(r: dict[str, Any]) -> str:
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    lines = [f"GPU path             {r['gpu_path']}"
             + ("" if r["gpu_path"] != "none" else f"  ({r['why_no_gpu'] or 'no GPU'})"),
             f"NVIDIA driver        {r['nvidia_kernel_driver'] or 'not loaded'}"
             f"  (CUDA driver API {r['cuda_driver_api'] or '-'}, cuda-bindings {r['cuda_bindings'] or 'not installed'})",
             f"checkpoint API       {yes(r['checkpoint_api'])}",
             f"custom storage       {yes(r['custom_storage'])}"]
    for g in r["gpus"]:
        cc = ".".join(map(str, g["compute_capability"]))
        lines.append(f"GPU {g['index']}                {g['name']} sm_{cc.replace('.', '')} {g['total_bytes'] / 2**30:.0f} GiB "
                     f"{g['uuid']} NUMA {g['numa_node'] if g['numa_node'] is not None else '-'} "
                     f"decompression engine {yes(g['decompression_engine'])}")
    lines += [f"nvCOMP               {r['nvcomp'] or 'not usable: ' + (r['nvcomp_missing'] or 'unknown reason')}",
              f"huge pages           THP {r['transparent_hugepages'] or '-'}, hugetlb pool "
              f"{r['hugetlb'].get('HugePages_Total', 0)} pages; copies and restores: {r['thp_policy']} (GPUSNAP_THP)",
              *([f"  note: this machine hands free memory back to its hypervisor (free page reporting, order "
                 f"{r['free_page_reporting_order']}): huge page faults may be slow here; compare a restore with "
                 "GPUSNAP_THP=keep"] if r.get("free_page_reporting_order") is not None and r["thp_policy"] == "always" else []),
              f"NUMA nodes           {r['numa_nodes']}",
              f"memory tier          {'yes (gpusnap pool serve)' if r['memory_tier'] else 'no (needs custom storage)'}",
              f"dump encoders        {r['dump_encoders'] or 'none'}"
              + (" processes" if isinstance(r["dump_encoders"], int) and r["dump_encoders"] else
                 "" if isinstance(r["dump_encoders"], str) else
                 " (the dump encodes in its own threads; GPUSNAP_ENCODE_PROCS)"),
              f"host codec           zstd through {'libzstd' if r['host_codec']['libzstd'] else 'python-zstandard'}, "
              f"byte planes in {r['host_codec']['byte_planes']}, delta page counts in {r['host_codec']['page_counts']}, "
              f"CRIU's pipes read in {r['host_codec']['pipe_reads']}"
              + ("" if r["host_codec"]["byte_planes"] == r["host_codec"]["page_counts"] == "C" else
                 " (storage/native not built: python3 -m storage.native.build, or GPUSNAP_NO_NATIVE is set)"),
              _render_pipes(r["pipes"]),
              f"dump packs           {r['dump_writes']}",
              f"CRIU                 {r['criu'] or 'not found'}",
              f"GPUs in CRIU dumps   {r['criu_gpu_handler']}",
              render_criu_binary(r["criu_binary"]),
              render_network_lock(r["criu_network_lock"]),
              f"runsc                {r['runsc'] or 'not found'}"]
    lines += _render_container_hook(r["container_hook"])
    lines += [f"  warning: runc/Podman run {f}" for f in r.get("criu_for_runtimes_known_failures", [])]
    rf = r.get("runsc_features")
    if rf:
        lines.append(f"runsc features       GPU sandboxes (nvproxy) {yes(rf['nvproxy'])}, uncompressed checkpoint "
                     f"(dedup) {yes(rf['uncompressed_checkpoint'])}, platforms {', '.join(rf['platforms']) or '-'}")
    return "\n".join(lines)
