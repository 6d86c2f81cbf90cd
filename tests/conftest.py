import os

# With libtpu installed (the `test` extra, for the TPU compile tests) JAX probes for a TPU at start-up:
# these two keep that probe quiet and local on a machine without one (no metadata-server query).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# `make test` runs the modules on two pytest-xdist workers, each a jax process: without this the second one
# cannot take libtpu's lockfile and its TPU compile tests would find no TPU backend
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# XLA's compile time is most of the suite's: its CPU backend at optimization level 0 compiles the test steps
# about a third faster (jaxpaged/testing/xla_env.py; subprocesses take it through `subprocess_env`)
from jaxpaged.testing.xla_env import FAST_COMPILE, with_flags  # noqa: E402  (before any jax backend starts)

os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), FAST_COMPILE)

import pytest

# The test extra installs the jax-cuda plugin (tests/test_gpu_compile.py compiles for sm_90a with it). On
# a machine without CUDA libraries its start-up version check logs a traceback before JAX falls back to
# the CPU; skipping that check keeps the suite's output as it was (a real GPU still starts).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from jaxpaged.testing.tiny_models import FAMILIES, make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for the session: engines of equal shapes compile once. Under pytest-xdist
    the workers share it (their base temp directories are siblings): a step one worker compiled, the other
    reads."""
    import jax
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla_cache"
    d.mkdir(exist_ok=True)
    d = str(d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return d


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> directory of a tiny random model (float32, peaked logits)."""
    root = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(str(root / f), f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def engine_kwargs(compile_cache):
    """The test engines' settings. warmup off: an engine compiles the step shapes its requests take, not
    every bucket (a test about warmup turns it on)."""
    return dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                compilation_cache_dir=compile_cache, show_progress=False, warmup=False)


# The modules that take longest (whole-module durations of a `make test` run, longest first). `make test`
# runs with --no-loadscope-reorder, so the two xdist workers take modules in this order, these first: a
# long module started last would leave one worker running it alone at the end.
SLOWEST_FIRST = ("test_spec_compose", "test_tensor_parallel", "test_structured", "test_tpu_compile",
                 "test_multihost", "test_paged_attention_cpu", "test_families", "test_bench_smoke",
                 "test_default_model", "test_tunix_rollout", "test_batch_invariance", "test_paged_attention_mosaic_tpu")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    module = lambda item: item.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    items.sort(key=lambda item: rank.get(module(item), len(rank)))  # stable: the others keep their order
