"""page_differences in C (storage/native/pages.c) against numpy's, and the native loader's refusals."""
from __future__ import annotations

import os

import numpy as np
import pytest

from storage import native

from storage.codecs import delta

PAGE = delta.PAGE


def _numpy(x: memoryview, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    with monkeypatch.context() as m:
        m.setattr(delta, "_pages", False)
        return delta.page_differences(x)


def test_built() -> None:
    if os.environ.get("GPUSNAP_NO_NATIVE"):
        pytest.skip("$GPUSNAP_NO_NATIVE is set")
    assert delta.native_page_counts(), "storage/native/libgpusnap_pages.so is not built (python3 -m storage.native.build)"


@pytest.mark.parametrize("n", [0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, 4 << 20])
@pytest.mark.parametrize("kind", ["zeros", "sparse", "dense"])
def test_counts_match_numpy(n: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not delta.native_page_counts():
        pytest.skip("the library is not built")
    rng = np.random.default_rng(n)
    a = np.zeros(n, np.uint8)
    if kind == "sparse" and n:
        where = rng.integers(0, n, max(1, n // 5000))
        a[where] = rng.integers(1, 256, len(where), dtype=np.uint8)
        a[-1] = 7  # the last (partial) page too
    elif kind == "dense":
        a[:] = rng.integers(0, 256, n, dtype=np.uint8)
    x = memoryview(bytearray(a.tobytes()))
    got = delta.page_differences(x)
    want = _numpy(x, monkeypatch)
    assert got.dtype == want.dtype and got.shape == want.shape == ((n + PAGE - 1) // PAGE,)
    np.testing.assert_array_equal(got, want)
    assert int(got.sum()) == int(np.count_nonzero(a))
    ro = memoryview(bytes(x))  # a read-only view (a base, a payload) counts the same
    np.testing.assert_array_equal(delta.page_differences(ro), want)


def test_loader_refuses_what_it_must(tmp_path: "os.PathLike[str]") -> None:
    import ctypes
    import shutil
    src = native.path_of("libgpusnap_pages.so")
    if not os.path.isfile(src):
        pytest.skip("the library is not built")
    lib = os.path.join(tmp_path, "p.so")
    shutil.copy(src, lib)
    os.chmod(lib, 0o755)
    fns = [("gs_page_differences", ctypes.c_int64, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p])]
    assert native.load(lib, "gs_pages_version", 1, fns) is not None
    assert native.load(lib, "gs_pages_version", 2, fns) is None           # another ABI
    assert native.load(lib, "gs_no_such_version", 1, fns) is None         # not this library
    assert native.load(lib, "gs_pages_version", 1, [("gs_missing", None, [])]) is None
    link = os.path.join(tmp_path, "link.so")
    os.symlink(lib, link)
    assert native.load(link, "gs_pages_version", 1, fns) is None          # a link, even to a good file
    held, fds = len(native._HELD), len(os.listdir("/proc/self/fd"))
    os.chmod(lib, 0o775)
    assert native.load(lib, "gs_pages_version", 1, fns) is None           # group may write it
    assert len(native._HELD) == held and len(os.listdir("/proc/self/fd")) == fds  # refused: nothing left open
    os.chmod(lib, 0o755)
    if os.geteuid() == 0:
        os.chown(lib, 65534, 65534)
        assert native.load(lib, "gs_pages_version", 1, fns) is None       # another user's file


def test_build_versions_are_the_modules_and_a_library_of_another_version_is_built_again(tmp_path: "os.PathLike[str]") -> None:
    """build.LIBRARIES names the versions the loading modules ask for; a library newer than its source
    but of another version (carried from another tree) is built again, a current one kept as it is."""
    import shutil
    from storage.codecs import shufflelib
    from storage.fs import fdread
    from storage.native import build
    versions = {lib: (fn, abi) for _, lib, fn, abi in build.LIBRARIES}
    assert versions["libgpusnap_shuffle2.so"] == ("gs_shuffle2_version", shufflelib.ABI)
    assert versions["libgpusnap_fdread.so"] == ("gs_fdread_version", fdread.ABI)
    assert versions["libgpusnap_pages.so"] == ("gs_pages_version", 1)  # storage/codecs/delta.py's _pages_lib
    if not (shutil.which("cc") or shutil.which("gcc")) or os.environ.get("GPUSNAP_NO_NATIVE"):
        pytest.skip("no C compiler, or loading is turned off")
    d = str(tmp_path)
    os.chmod(d, 0o755)
    for src, *_ in build.LIBRARIES:
        shutil.copy(os.path.join(native.HERE, src), d)
    libs = build.build(directory=d)
    lib = os.path.join(d, "libgpusnap_fdread.so")
    first = os.stat(lib).st_mtime_ns
    assert build.build(directory=d) == libs and os.stat(lib).st_mtime_ns == first  # current: kept
    src = os.path.join(d, "fdread.c")
    with open(src) as f:
        text = f.read()
    with open(src, "w") as f:
        f.write(text.replace("return 3; }", "return 99; }"))
    build.build(directory=d, force=True)  # a library of another version...
    with open(src, "w") as f:
        f.write(text)
    os.utime(lib, ns=(first + 10**10, first + 10**10))  # ...newer than its source
    assert not build._current(src, lib, "gs_fdread_version", fdread.ABI)
    build.build(directory=d)
    assert build._current(src, lib, "gs_fdread_version", fdread.ABI)  # built again, at the modules' version
