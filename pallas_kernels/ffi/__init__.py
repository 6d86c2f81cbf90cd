"""The C++ kernels' loader and shared header (loader.py, ffi_common.h)."""
from pallas_kernels.ffi.loader import build_kernel, build_key, load_kernel

__all__ = ["build_kernel", "build_key", "load_kernel"]
