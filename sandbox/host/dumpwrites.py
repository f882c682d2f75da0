"""How a dump writes its packs: through the page cache, or past it (O_DIRECT), decided once per dump.

Through the page cache by default, so that a restore on the same node soon after finds the packs
there. Past it where this machine hands free memory back to its hypervisor (free page reporting, see
hugepages.free_page_reporting): there every page-cache page a dump fills may first have to be faulted
back in from the host, and on the 2-core development VM a 1 GiB CRIU dump took 4.4-9.8 s with buffered
packs against 2.0-2.7 s with direct ones, four dumps each, alternating (BENCHMARKS.md section 39). The
GPU hosts measured have no balloon; on the H200 direct pack entries made no difference beyond the
spread to a put's ingest (section 19). A dump's report says how its packs were written
(`pack_writes`: the writer's mode at the end, "buffered" if it fell back part way).
$GPUSNAP_DUMP_DIRECT=0 or 1 decides instead (dump_direct).
"""
from __future__ import annotations

from sandbox.host.hugepages import free_page_reporting
from storage.api import switch


def dump_direct() -> bool | None:
    """$GPUSNAP_DUMP_DIRECT: 1 a dump writes its packs with O_DIRECT, 0 through the page cache, None
    (unset) this module decides. Anything but 0 or 1 is refused (SettingError)."""
    return switch("GPUSNAP_DUMP_DIRECT", None)


def decision() -> tuple[bool, str]:
    """Whether this dump writes its packs with O_DIRECT (where the store's file system takes it: the
    writer falls back to the page cache where it does not), and why, in words. SettingError for a bad
    $GPUSNAP_DUMP_DIRECT."""
    asked = dump_direct()
    if asked is not None:
        return asked, f"written {'past' if asked else 'through'} the page cache (GPUSNAP_DUMP_DIRECT={int(asked)})"
    if free_page_reporting() is not None:
        return True, ("written past the page cache (O_DIRECT, where the store's file system takes it): this "
                      "machine hands free memory back to its hypervisor")
    return False, "written through the page cache (a restore on this node soon after finds them there)"


def dump_packs_direct() -> bool:
    """decision()'s answer alone; callers ask once, before anything is frozen."""
    return decision()[0]


def describe() -> str:
    """One line for doctor: how dumps write their packs here, and why."""
    return decision()[1]
