"""Attention chosen from the target devices (jaxpaged/step/attention.py) and the step compiled ahead of
time over an abstract model (jaxpaged/step/aot.py)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.step import attention
from jaxpaged.step.aot import abstract_params, abstract_runner, compile_steps
from jaxpaged.step.mesh import make_mesh


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str = ""
    compute_capability: str | None = None


H200 = FakeDevice("gpu", "NVIDIA H200", "9.0")
A100 = FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
TOPOLOGY_H100 = FakeDevice("cuda", "NVIDIA H100 80GB HBM3")  # compile-only: capability from its name
TPU = FakeDevice("tpu", "TPU v5 lite")
CPU = FakeDevice("cpu", "cpu")


@pytest.mark.parametrize("asked, device, want", [
    ("auto", CPU, "cpu kernel"), ("auto", H200, "mosaic_gpu"), ("auto", A100, "triton"), ("auto", TPU, "mosaic_tpu"),
    ("pallas", CPU, "triton"), ("pallas", H200, "mosaic_gpu"), ("pallas", TOPOLOGY_H100, "mosaic_gpu"),
    ("pallas", A100, "triton"), ("pallas", TPU, "mosaic_tpu"), ("mosaic", H200, "mosaic_gpu"),
    ("mosaic", TPU, "mosaic_tpu"), ("triton", H200, "triton"), ("mosaic_gpu", CPU, "mosaic_gpu"),
    ("mosaic_tpu", CPU, "mosaic_tpu"), ("reference", TPU, "reference")])
def test_backend_from_target_devices(asked, device, want):
    if want == "cpu kernel":  # the C++ kernel where its vector path was built here, else the reference
        from pallas_kernels.attention import cpu as cpu_ffi
        want = "cpu" if cpu_ffi.vectorized() else "reference"
    assert attention.resolve_backend(asked, 128, 16, [device]) == want


@pytest.mark.parametrize("asked, device, match", [
    ("mosaic", CPU, "ambiguous"), ("triton", TPU, "runs on gpu targets, not tpu"),
    ("mosaic_tpu", H200, "runs on tpu targets"), ("mosaic_gpu", A100, "needs sm_90"), ("flash", CPU, "must be one of")])
def test_backend_refused_by_name(asked, device, match):
    with pytest.raises(ValueError, match=match):
        attention.resolve_backend(asked, 128, 16, [device])


def test_backend_shapes_and_registry():
    with pytest.raises(ValueError, match="power-of-two block_size"):
        attention.resolve_backend("pallas", 96, 16, [CPU])
    assert attention.resolve_backend("auto", 96, 16, [H200]) == "reference"  # shapes the kernels cannot take
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig(attention_backend="mosaic_gpu2")


TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def test_abstract_params_allocate_nothing_and_shard():
    mc = ModelConfig.from_hf_dict(TINY)
    p = abstract_params(mc, "bfloat16", "int8", make_mesh(1))
    leaves = jax.tree.leaves(p)
    assert leaves and all(isinstance(a, jax.ShapeDtypeStruct) and a.sharding is not None for a in leaves)
    assert p["layers"]["wq"].q.dtype == np.int8 and p["layers"]["wq"].q.shape == (2, 64, 64)


def test_abstract_step_compiles_like_the_engine():
    """The abstract runner compiles the same step as a real one: same output shapes, the pools donated,
    memory and cost analyses available."""
    mc = ModelConfig.from_hf_dict(TINY)
    cfg = EngineConfig(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                       compilation_cache_dir=None, attention_backend="reference")
    runner = abstract_runner(mc, cfg, make_mesh(1), num_blocks=32)
    assert runner.variants() == [(8, False, False), (16, False, False)]
    steps = compile_steps(runner, [(8, False)])
    exe = steps[(8, False)]
    assert exe.memory_analysis() is not None and exe.cost_analysis()
    (tokens, *_), _ = exe.out_info[0]
    assert tokens.shape == (4,)
    k_pool = exe.out_info[1]
    assert k_pool.shape == (2 * 32, 4, 2, 16)  # [L*N, bs, Hkv, hd]
    assert exe.memory_analysis().alias_size_in_bytes >= 2 * k_pool.size * 4  # both pools updated in place
