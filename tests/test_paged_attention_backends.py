"""The registry of attention implementations (pallas_kernels/attention/backends.py) as the engine's resolver
walks it: what "auto" picks for the step's dtypes and KV cache, and explicit names refused with the limit."""
from __future__ import annotations

import dataclasses

import pytest

from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.step.aot import abstract_runner
from jaxpaged.step.attention import resolve_backend
from jaxpaged.step.mesh import make_mesh
from pallas_kernels.attention import backends, cpu


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str = ""
    compute_capability: str | None = None


CPU, H200, TPU = FakeDevice("cpu", "cpu"), FakeDevice("gpu", "NVIDIA H200", "9.0"), FakeDevice("tpu", "TPU v5 lite")
KERNEL = "cpu" if cpu.vectorized() else "reference"  # the C++ kernel where its vector path was built here


@pytest.mark.parametrize("kv, dtype, want", [
    ("auto", "float32", KERNEL), ("auto", "bfloat16", KERNEL), ("bfloat16", "float32", KERNEL),
    ("int8", "float32", "reference"), ("float8_e4m3fn", "bfloat16", "reference"),
    ("auto", "float16", "reference")])  # the kernel reads float32 / bfloat16 pools only
def test_auto_on_cpu_follows_the_kv_cache(kv, dtype, want):
    assert resolve_backend("auto", 64, 16, [CPU], dtype=dtype, kv_cache_dtype=kv) == want


def test_auto_passes_over_the_plain_loop_path():
    """Blocks over the vector path's 128 would run the C++ kernel's plain loops (slower than the reference)."""
    assert resolve_backend("auto", 64, 128, [CPU], dtype="float32") == KERNEL
    assert resolve_backend("auto", 64, 256, [CPU], dtype="float32") == "reference"
    assert resolve_backend("cpu", 64, 256, [CPU], dtype="float32") == "cpu"  # asked for: it runs


@pytest.mark.parametrize("asked, device, kw, match", [
    ("cpu", CPU, dict(dtype="float32", kv_cache_dtype="int8"),
     "attention_backend='cpu' reads KV pools of float32 / bfloat16, not int8 \\(kv_cache_dtype"),
    ("cpu", CPU, dict(dtype="float16"), "attention_backend='cpu' reads KV pools .* not float16"),
    ("mosaic_tpu", TPU, dict(dtype="float16"), "attention_backend='mosaic_tpu' computes in float32 / bfloat16, "
                                                "not dtype float16"),
    ("pallas", TPU, dict(dtype="bfloat16"), "attention_backend='mosaic_tpu' needs block_size a multiple of 8"),
    ("cpu", H200, {}, "attention_backend='cpu' runs on cpu targets, not gpu")])
def test_explicit_unsupported_names_the_limit(asked, device, kw, match):
    head_dim, block_size = (64, 4) if asked == "pallas" else (64, 16)
    with pytest.raises(ValueError, match=match):
        resolve_backend(asked, head_dim, block_size, [device], **kw)


def test_quantized_kv_runs_on_the_kernels_that_read_it():
    for name, device in (("triton", CPU), ("mosaic_gpu", H200), ("mosaic_tpu", TPU)):
        assert resolve_backend(name, 64, 16, [device], dtype="bfloat16", kv_cache_dtype="int8") == name
    assert resolve_backend("auto", 64, 16, [H200], dtype="bfloat16", kv_cache_dtype="float8_e4m3fn") == "mosaic_gpu"


def test_registry_order_and_decode_kernels():
    assert list(backends.BACKENDS)[-1] == "reference"  # auto's last resort runs everything
    assert backends.DECODE_KERNELS == ("mosaic_gpu", "triton")
    assert backends.BACKENDS["reference"].unsupported(backends.Config("tpu", None, 96, 3, None, None)) is None


TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


@pytest.mark.parametrize("kv, want", [("int8", "reference"), ("float8_e4m3fn", "reference"), ("auto", KERNEL)])
def test_runner_reports_what_runs(kv, want):
    """The runner's backend (stats()["attention_backend"]) names what runs: an int8 / fp8 KV cache on a CPU
    target is the reference's, never the C++ kernel's name over the reference."""
    cfg = EngineConfig(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=16,
                       compilation_cache_dir=None, kv_cache_dtype=kv)
    runner = abstract_runner(ModelConfig.from_hf_dict(TINY), cfg, make_mesh(1), num_blocks=32)
    assert runner.backend == want
