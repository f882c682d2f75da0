"""Cold-cache measurements for the benchmarks: sync, then drop the kernel's page cache."""
import os
import sys


def drop_caches(required: bool = False) -> bool:
    """Sync and drop the page cache (root only). Without root: raise if REQUIRED, else warn once."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError as e:
        if required:
            raise SystemExit(f"cannot drop the page cache ({e.strerror}): run the benchmark as root") from None
        print("(cannot drop caches: not root; read figures include the page cache)", file=sys.stderr)
        return False
