"""Native helpers gpusnap builds from C at setup (storage/native/build.py) and loads through ctypes.

Each is optional: without it (no compiler at setup, or $GPUSNAP_NO_NATIVE set) the module that uses
it falls back to numpy, with the same results.
"""
