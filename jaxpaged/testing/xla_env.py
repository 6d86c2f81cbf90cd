"""XLA flags for test processes: compile fast, and simulate several CPU devices in a subprocess.

A test compiles hundreds of small steps and runs each a few times, so XLA's compile time is most of the
suite's: at `--xla_backend_optimization_level=0` its CPU backend skips LLVM's optimization passes (the HLO
passes, and so the computation, are unchanged; the machine code is slower, which tiny test models do not
notice; a server running the 135M default model for many tokens does, and turns it off). `tests/conftest.py`
sets it for the pytest process; `subprocess_env` carries it into a subprocess beside the device count that
must be fixed before JAX starts there. Benchmarks and users never
take it (their compiled steps run for hours).
"""
from __future__ import annotations

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


def with_flags(flags: str, *more: str) -> str:
    """`flags` (an XLA_FLAGS value) with each of `more` added unless already there."""
    out = flags.split()
    out += [f for f in more if f not in out]
    return " ".join(out)


def subprocess_env(devices: int | None = None, fast_compile: bool = True, **extra: str) -> dict:
    """os.environ for a subprocess that runs JAX: this process's XLA_FLAGS (the fast compile with them, unless
    `fast_compile` is False: a subprocess that runs a real model for many steps, where optimized code pays),
    `devices` simulated CPU devices when given, and `extra` variables."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count=") and (fast_compile or f != FAST_COMPILE)]
    more = [f"--xla_force_host_platform_device_count={devices}"] if devices is not None else []
    return {**os.environ, "XLA_FLAGS": with_flags(" ".join(flags), *more), **extra}
