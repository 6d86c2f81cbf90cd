"""The runner's weights on transparent huge pages (jaxpaged/step/huge_pages.py): the spans it advises lie inside
the buffer, what it reports collapsed is backed by huge pages (read back from /proc/self/smaps), the values stay,
and anything but a jax.Array is refused by name."""
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.step import huge_pages

HUGE = huge_pages.HUGE


def test_spans_stay_inside_the_buffer():
    assert huge_pages.spans(HUGE + 4096, 3 * HUGE) == (2 * HUGE, 4 * HUGE)
    assert huge_pages.spans(2 * HUGE, 2 * HUGE) == (2 * HUGE, 4 * HUGE)
    start, end = huge_pages.spans(HUGE + 4096, HUGE)  # no whole huge page inside
    assert start == end


def huge_bytes_at(start: int, end: int) -> int:
    """AnonHugePages (bytes) of the mappings of this process that overlap [start, end)."""
    total, overlap = 0, False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            overlap = lo < end and start < hi
        elif overlap and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_collapse_backs_what_it_reports_and_keeps_the_values():
    want = np.random.default_rng(0).integers(0, 256, (5 * HUGE,), dtype=np.uint8)
    a = jnp.asarray(want)
    done = huge_pages.collapse([a])
    if done == 0:
        pytest.skip("the kernel declined huge pages here (THP off, none free, or before Linux 6.1)")
    start, end = huge_pages.spans(a.unsafe_buffer_pointer(), a.nbytes)
    assert done == end - start >= 4 * HUGE
    assert huge_bytes_at(start, end) >= done
    np.testing.assert_array_equal(np.asarray(a), want)


def test_anything_but_a_jax_array_is_refused_by_name():
    with pytest.raises(ValueError, match=r"arrays\[1\] must be a jax.Array, got ndarray"):
        huge_pages.collapse([jnp.zeros(3), np.zeros(3)])


@pytest.mark.parametrize("matmul_backend, collapsed", [("cpu", True), ("xla", False)])
def test_the_runner_collapses_the_weights_a_cpu_kernel_reads(tiny_models, engine_kwargs, monkeypatch,
                                                            matmul_backend, collapsed):
    """bfloat16 products on the C++ kernel: every placed weight array goes to `collapse` once (its lone-row
    reads run faster from huge pages); XLA's dot: none."""
    from jaxpaged import LLM
    from jaxpaged.step import runner
    from pallas_kernels.matmul import cpu as cpu_matmul
    if matmul_backend == "cpu" and not cpu_matmul.available():
        pytest.skip("the C++ matmul kernel is not built here (no compiler)")
    seen = []
    monkeypatch.setattr(runner.huge_pages, "collapse", lambda arrays: seen.append(list(arrays)) or 0)
    llm = LLM(model=tiny_models["llama"], **{**engine_kwargs, "dtype": "bfloat16", "matmul_backend": matmul_backend})
    r = llm.engine.runner
    assert r.step_cfg.cpu_matmul == collapsed
    params = [id(a) for a in jax.tree.leaves(r.params) if isinstance(a, jax.Array)]
    assert [[id(a) for a in arrays] for arrays in seen] == ([params] if collapsed else [])
