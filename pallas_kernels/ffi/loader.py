"""The one loader of the C++ kernels: compile a source with the system compiler, cache the shared library,
load it with ctypes and register its XLA FFI handler for the CPU platform, or warn once and report it
unavailable (callers then take their fallback).

The compiler is ``$CXX``, else ``g++``; the target is ``-march=native`` (``$JAXPAGED_CPU_KERNEL_MARCH``
overrides it: ``haswell`` builds the AVX2 paths on any newer x86-64). Every kernel includes
``ffi_common.h`` (this folder: the FFI API, bfloat16 widening, the thread fan-out). Libraries are cached
under ``$XDG_CACHE_HOME/jaxpaged/cpu_kernels`` (default ``~/.cache``) by a build key that changes with
anything that changes the binary: the source, every header of this package it includes (transitively),
jaxlib's version, the compiler's resolved path and ``--version`` output, every compile flag (``-march``
included) and the CPU's flags.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile

import jax
import jaxlib

logger = logging.getLogger(__name__)
INCLUDE_DIR = os.path.dirname(os.path.abspath(__file__))  # ffi_common.h
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def compiler() -> str:
    """The C++ compiler's resolved path; RuntimeError when there is none."""
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found)")
    return path


@functools.cache
def compiler_version(path: str) -> str:
    """`path --version`'s output (the compiler's identity: an upgrade in place keeps its path)."""
    done = subprocess.run([path, "--version"], capture_output=True, text=True)
    return done.stdout + done.stderr


def compile_flags() -> list[str]:
    """Every flag a kernel is compiled with (the source and the output excluded)."""
    march = os.environ.get("JAXPAGED_CPU_KERNEL_MARCH", "native")
    return [*FLAGS, f"-march={march}", "-I", INCLUDE_DIR, "-I", jax.ffi.include_dir()]


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo), which -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def local_headers(source_path: str) -> list[str]:
    """The headers `source_path` includes with quotes that sit beside it or in INCLUDE_DIR, transitively,
    in first-seen order (headers found elsewhere, XLA's, are covered by jaxlib's version)."""
    seen, todo = [], [source_path]
    while todo:
        path = todo.pop(0)
        with open(path, "rb") as f:
            names = _LOCAL_INCLUDE.findall(f.read())
        for name in names:
            for d in (os.path.dirname(os.path.abspath(path)), INCLUDE_DIR):
                found = os.path.join(d, name.decode())
                if os.path.isfile(found):
                    if found not in seen:
                        seen.append(found)
                        todo.append(found)
                    break
    return seen


def build_key(source_path: str, cxx: str, flags: list[str]) -> str:
    """The cache key of `source_path` compiled by `cxx` with `flags` on this CPU (hex sha256)."""
    h = hashlib.sha256()
    parts = [cxx.encode(), compiler_version(cxx).encode(), jaxlib.__version__.encode(), cpu_flags().encode(),
             "\0".join(flags).encode()]
    for path in [source_path, *local_headers(source_path)]:
        with open(path, "rb") as f:
            parts += [os.path.basename(path).encode(), f.read()]
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _cache_dir() -> str:
    # the same root as the engine's caches (~/.cache/jaxpaged), found here without importing the engine:
    # pallas_kernels knows nothing of jaxpaged
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpaged", "cpu_kernels")


def build_kernel(source_path: str) -> str:
    """Compile `source_path` (once per build key) -> the shared library's path; RuntimeError on failure."""
    cxx, flags = compiler(), compile_flags()
    key = build_key(source_path, cxx, flags)
    out_dir = _cache_dir()
    op = os.path.basename(os.path.dirname(os.path.abspath(source_path)))  # the op's folder: matmul, argmax, ..
    stem = os.path.splitext(os.path.basename(source_path))[0]
    lib = os.path.join(out_dir, f"{op}-{stem}-{key[:16]}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, *flags, source_path, "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(tmp, lib)  # atomic: concurrent builders agree
    return lib


def load_kernel(source_path: str, handler: str, target: str, instead: str):
    """Build `source_path`, load it and register its FFI `handler` symbol as the CPU FFI `target` -> the
    loaded library (ctypes.CDLL, for the kernel's other exported C functions); None, with one warning saying
    what runs `instead`, when that cannot be done here. Call once per kernel (each caches it)."""
    try:
        lib = ctypes.cdll.LoadLibrary(build_kernel(source_path))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, handler)), platform="cpu")
    except Exception as e:  # noqa: BLE001 — any failure means: the fallback
        logger.warning("CPU kernel %s unavailable, using %s: %s", os.path.relpath(source_path, os.path.dirname(
            INCLUDE_DIR)), instead, e)
        return None
    return lib
