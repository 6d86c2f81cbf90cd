"""The Mosaic TPU ragged kernel against the reference: natively on a TPU, else in Pallas TPU interpret mode (DMAs,
semaphores and SMEM simulated), over the kernel test cases: each case once."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernel_options import LONG_RAGGED, OPTIONS
from test_kv_quant import quantized
from test_paged_attention_kernels import BS, PAD_ROWS, RAGGED, TOL, make_case, ragged_case

from pallas_kernels.attention.mosaic_tpu import mosaic_tpu_ragged_paged_attention as tpu_ragged
from pallas_kernels.attention.reference import ragged_paged_attention_reference as reference

INTERPRET = jax.devices()[0].platform != "tpu"  # natively on a TPU (scripts/tpu_check.sh)


def _check(case, tol, **kw):
    got = tpu_ragged(**case, interpret=INTERPRET, **kw)
    opts = {k: v for k, v in kw.items() if k in ("window", "softcap", "scale")}
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(reference(**case, **opts), np.float32), **tol)
    T = case["q"].shape[0]
    assert not np.asarray(got[int(case["query_start_loc"][-1]):T]).any(), "padding rows must be zero"


# (seed, head_dim, GQA group, dtype, tuning): the default model's heads (64, group 3) and Llama's (128, 4)
CASES = [(0, 64, 3, jnp.float32, {}), (1, 128, 4, jnp.bfloat16, {}),
         (2, 64, 1, jnp.float32, dict(block_q=8, blocks_per_iter=1)),  # many slots a program, chunk = block
         (3, 128, 2, jnp.float32, dict(block_q=32, blocks_per_iter=3))]  # ragged last chunk past the table


@pytest.mark.parametrize("seed,head_dim,group,dtype,tuning", CASES, ids=["hd64-g3", "hd128-bf16", "small", "wide"])
def test_ragged_matches_reference(seed, head_dim, group, dtype, tuning):
    case, _ = ragged_case(seed, head_dim=head_dim, group=group, dtype=dtype)
    _check(case, TOL[dtype], **tuning)


def test_decode_only_step():
    """T == S: every slot one row (empty slots have seq_lens 0 and no rows), as in a decode bucket."""
    lens = [1, BS - 1, BS, BS + 1, 3 * BS + 5, 0, 5 * BS, 7]
    case, _ = make_case(5, lens, kv_heads=2, group=4)
    qlens = [1 if n else 0 for n in lens]
    case["query_start_loc"] = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    _check(case, TOL[jnp.float32])


@pytest.mark.parametrize("opts", [OPTIONS[1], OPTIONS[2]], ids=["w5-cap2", "w24-scale"])
def test_options(opts):
    case, _ = ragged_case(6, slots=LONG_RAGGED, group=2)
    _check(case, TOL[jnp.float32], blocks_per_iter=2, **opts)


def test_stale_nan_outside_every_window():
    """NaN in every pool position no query sees (including blocks a window leaves behind) changes nothing."""
    case, used = ragged_case(7, slots=LONG_RAGGED, group=2)
    k, v = np.array(case["k_pool"]), np.array(case["v_pool"])
    k[~used], v[~used] = np.nan, np.nan
    nan_case = {**case, "k_pool": jnp.asarray(k), "v_pool": jnp.asarray(v)}
    np.testing.assert_allclose(tpu_ragged(**nan_case, interpret=INTERPRET, window=20, blocks_per_iter=1),
                               reference(**case, window=20), **TOL[jnp.float32])


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_quantized_pools(dtype):
    case, _ = ragged_case(8, group=4, head_dim=64)
    qc, _ = quantized(case, dtype)
    _check(qc, dict(atol=1e-4, rtol=1e-4), softcap=30.0, window=20)


def test_bfloat16_queries_on_a_quantized_pool():
    case, _ = ragged_case(9, group=2, head_dim=128)
    qc, _ = quantized(case, "int8")
    qc["q"] = qc["q"].astype(jnp.bfloat16)
    _check(qc, TOL[jnp.bfloat16])


def test_validation_errors():
    case, _ = ragged_case(0)
    bad = [(dict(q=case["q"][..., :32], k_pool=case["k_pool"][..., :32], v_pool=case["v_pool"][..., :32]),
            "head_dim"),
           (dict(k_pool=case["k_pool"][:, :12], v_pool=case["v_pool"][:, :12]), "block_size"),
           (dict(query_start_loc=case["query_start_loc"][:-1]), "query_start_loc"),
           (dict(k_pool=case["k_pool"].astype(jnp.int8), v_pool=case["v_pool"].astype(jnp.int8)), "k_scale"),
           (dict(block_q=12), "block_q"), (dict(blocks_per_iter=0), "blocks_per_iter"), (dict(num_warps=4), "knobs"),
           (dict(window=0), "window")]
    for change, word in bad:
        with pytest.raises(ValueError, match=word):
            tpu_ragged(**{**case, **change}, interpret=INTERPRET)


def test_padding_rows_beyond_a_full_block():
    """More padding rows than a program's block: whole programs with no slot return zeros."""
    case, _ = ragged_case(10, slots=RAGGED[:3], pad_rows=PAD_ROWS + 24)
    _check(case, TOL[jnp.float32], block_q=16)


def test_bench_tpu_kernel_smoke(tmp_path):
    """jaxpaged/bench/tpu_kernel.py --cpu-smoke: tiny shapes in interpret mode, every row checked."""
    from jaxpaged.bench import tpu_kernel
    res = tpu_kernel.main(["--cpu-smoke", "--out", str(tmp_path)])
    assert [r["shape"] for r in res["rows"]] == ["decode 2 x 40", "mixed 2 x 40 + prefill [20]"]
    assert all(r["max_abs_diff"] < 2e-2 for r in res["rows"])
    assert (tmp_path / "results.md").read_text().count("|") > 10


@pytest.mark.slow
def test_engine_on_the_tpu_kernel_matches_reference(tmp_path, engine_kwargs):
    """The engine with attention_backend="mosaic_tpu" (TPU interpret mode on a CPU target) gives the
    reference backend's greedy tokens through prefill chunks mixed with decodes and decode-only steps
    (a tiny Llama with the default model's head_dim 64 and GQA 3)."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.testing.tiny_models import make_tiny_model
    path = make_tiny_model(str(tmp_path / "llama64"), "llama", hidden_size=192, num_heads=3, num_kv_heads=1,
                           head_dim=64)
    prompts = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(i).integers(3, 256, size=n)]}
               for i, n in enumerate((3, 20, 37))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    kw = {**engine_kwargs, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    want = [o.outputs[0].token_ids for o in LLM(model=path, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=path, **kw, attention_backend="mosaic_tpu")
    assert llm.stats()["attention_backend"] == "mosaic_tpu"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
