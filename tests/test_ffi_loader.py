"""The C++ kernels' loader (pallas_kernels/ffi/loader.py): the build key follows everything that changes the
binary, a kernel is rebuilt when it changes, and a kernel that cannot be built is reported unavailable."""
from __future__ import annotations

import logging
import os

import pytest

from pallas_kernels.argmax import cpu as cpu_argmax
from pallas_kernels.attention import cpu as cpu_attention
from pallas_kernels.ffi import build_kernel, build_key, load_kernel, loader
from pallas_kernels.matmul import cpu as cpu_matmul


def _key(source):
    return build_key(source, loader.compiler(), loader.compile_flags())


def test_every_kernel_includes_the_shared_header():
    """Each kernel's local headers (its build key's) are the shared one and, for the matmul, its own beside it."""
    header = os.path.join(loader.INCLUDE_DIR, "ffi_common.h")
    assert loader.local_headers(cpu_argmax.SOURCE) == [header]
    own = os.path.join(os.path.dirname(cpu_attention.SOURCE), "cpu_dpbf16.h")
    assert sorted(loader.local_headers(cpu_attention.SOURCE)) == sorted([own, header])
    own = [os.path.join(os.path.dirname(cpu_matmul.SOURCE), h) for h in ("cpu_amx.h", "cpu_tiles.h", "cpu_vec.h")]
    assert sorted(loader.local_headers(cpu_matmul.SOURCE)) == sorted(own + [header])


def test_key_follows_the_compiler_version(monkeypatch):
    before = _key(cpu_argmax.SOURCE)
    assert _key(cpu_argmax.SOURCE) == before  # deterministic
    monkeypatch.setattr(loader, "compiler_version", lambda path: "g++ (GCC) 99.1.0")
    assert _key(cpu_argmax.SOURCE) != before


def test_key_follows_every_flag(monkeypatch):
    before = _key(cpu_argmax.SOURCE)
    monkeypatch.setattr(loader, "FLAGS", loader.FLAGS + ("-DJP_EXTRA=1",))
    assert _key(cpu_argmax.SOURCE) != before
    monkeypatch.setattr(loader, "FLAGS", tuple(f for f in loader.FLAGS if f not in ("-O3", "-DJP_EXTRA=1")) + ("-O2",))
    assert _key(cpu_argmax.SOURCE) != before
    monkeypatch.undo()
    monkeypatch.setenv("JAXPAGED_CPU_KERNEL_MARCH", "haswell")
    assert "-march=haswell" in loader.compile_flags() and _key(cpu_argmax.SOURCE) != before


def test_key_follows_the_compiler_path_and_the_cpu(monkeypatch):
    cxx, flags = loader.compiler(), loader.compile_flags()
    before = build_key(cpu_argmax.SOURCE, cxx, flags)
    monkeypatch.setattr(loader, "compiler_version", lambda path: "same version")
    same = build_key(cpu_argmax.SOURCE, cxx, flags)
    assert build_key(cpu_argmax.SOURCE, "/opt/other/g++", flags) != same
    monkeypatch.setattr(loader, "cpu_flags", lambda: "flags\t: fpu avx2")
    assert build_key(cpu_argmax.SOURCE, cxx, flags) not in (same, before)


def test_key_follows_included_headers(tmp_path):
    (tmp_path / "inner.h").write_text("#pragma once\nconstexpr int A = 1;\n")
    (tmp_path / "outer.h").write_text('#pragma once\n#include "inner.h"\n#include "xla/ffi/api/ffi.h"\n')
    (tmp_path / "k.cc").write_text('#include "outer.h"\nint f() { return A; }\n')
    src = str(tmp_path / "k.cc")
    assert loader.local_headers(src) == [str(tmp_path / "outer.h"), str(tmp_path / "inner.h")]
    cxx, flags = loader.compiler(), loader.compile_flags()
    before = build_key(src, cxx, flags)
    (tmp_path / "inner.h").write_text("#pragma once\nconstexpr int A = 2;\n")  # two levels down
    assert build_key(src, cxx, flags) != before


def test_a_changed_key_builds_a_new_library(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = build_kernel(cpu_argmax.SOURCE)
    assert first.startswith(str(tmp_path)) and os.path.basename(first).startswith("argmax-cpu-")
    assert build_kernel(cpu_argmax.SOURCE) == first  # cached
    monkeypatch.setattr(loader, "compiler_version", lambda path: "a newer compiler")
    second = build_kernel(cpu_argmax.SOURCE)
    assert second != first and os.path.exists(first) and os.path.exists(second)


def test_no_compiler_warns_and_reports_unavailable(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert load_kernel(cpu_argmax.SOURCE, "JaxpagedCpuArgmax", "jaxpaged_test_unbuilt", "jnp.argmax") is None
    assert "argmax/cpu.cc unavailable, using jnp.argmax" in caplog.text and "no C++ compiler" in caplog.text
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        build_kernel(cpu_argmax.SOURCE)


def test_each_kernel_without_a_compiler_warns_once_and_falls_back(monkeypatch, tmp_path, caplog):
    """No compiler: each kernel's library is None after one warning, `available()` is False, and what runs
    instead gives the reference's results (attention: the reference; matmul: XLA's dot; argmax: jnp.argmax)."""
    import functools

    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.step.attention import resolve_backend
    from jaxpaged.step.matmul import resolve_matmul
    from pallas_kernels.attention.reference import ragged_paged_attention_reference
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    for module in (cpu_attention, cpu_matmul, cpu_argmax):  # a fresh cache: the next use builds again
        monkeypatch.setattr(module, "_library", functools.cache(module._library.__wrapped__))
    monkeypatch.setattr(cpu_matmul, "isa", functools.cache(cpu_matmul.isa.__wrapped__))
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((8, 4, 2, 16)), jnp.float32) for _ in range(2))
    args = (jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32), k, v, jnp.array([[1, 2], [3, 4]], jnp.int32),
            jnp.array([6, 2], jnp.int32), jnp.array([0, 1, 3], jnp.int32))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        for _ in range(2):
            assert not cpu_attention.available() and not cpu_attention.vectorized()
            assert resolve_backend("auto", 16, 4) == "reference"
            np.testing.assert_array_equal(np.asarray(cpu_attention.cpu_ragged_paged_attention(*args)),
                                          np.asarray(ragged_paged_attention_reference(*args)))
            assert not cpu_matmul.available() and not cpu_matmul.amx()
            assert resolve_matmul("auto", jnp.bfloat16, "cpu", 1) is False
            with pytest.raises(ValueError, match="could not be built here"):
                resolve_matmul("cpu", jnp.bfloat16, "cpu", 1)
            assert not cpu_argmax.available() and "could not be built" in cpu_argmax.auto_skip()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # one a kernel
    for name, instead in (("attention", "the reference attention"), ("matmul", "XLA's dot"), ("argmax", "jnp.argmax")):
        assert sum(f"{name}/cpu.cc unavailable, using {instead}" in w and "no C++ compiler" in w for w in warnings) == 1
