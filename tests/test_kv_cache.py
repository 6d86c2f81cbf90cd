"""kv_cache_dtype through the engine (tiny model, reference attention on CPU): forced paths (preemption,
chunked prefill, prefix cache hits) keep each KV dtype's own outputs, the outputs stay close to the
float32 pool's, the pool is stored narrow with its scales, kv_cache_memory_gb buys more blocks, a failed
step rebuilds a quantized pool, and a bad value is a ValueError naming kv_cache_dtype."""
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_paths import _workload
from test_step_failure import GREEDY as FAILURE_GREEDY
from test_step_failure import _prompts, assert_all_free, run

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineConfig
from jaxpaged.engine import LLMEngine
from jaxpaged.step.kv_cache import QuantPool

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _tokens(llm, prompts=None, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts or _workload(), sp, use_tqdm=False)]


@pytest.mark.parametrize("kv", [pytest.param("bfloat16", marks=pytest.mark.slow), "int8",
                                pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
def test_forced_paths_keep_outputs(tiny_models, engine_kwargs, kv):
    """Per-token scales make a token's stored K/V independent of the step that wrote it: preempted,
    chunked or prefix-cached requests get the tokens of a plain run of the same kv_cache_dtype."""
    path = tiny_models["llama"]
    want = _tokens(LLM(model=path, **engine_kwargs, kv_cache_dtype=kv))
    llm = LLM(model=path, **{**engine_kwargs, "num_kv_blocks": 14, "max_num_batched_tokens": 16}, kv_cache_dtype=kv)
    assert _tokens(llm) == want
    again = _tokens(llm)  # prefix cache hits on the quantized blocks
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hit_rate"] > 0.2, s
    assert again == want and s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.mark.slow
def test_close_to_float32(tiny_models, engine_kwargs):
    """First tokens (prefill over the quantized pool) against the float32 pool: the logprob of the float32
    run's greedy token. Loose bounds: the tiny random model's logits are very peaked (init 0.5); the
    quality goals are measured on the default model (test_kv_quality.py)."""
    path = tiny_models["llama"]
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    ref = [o.outputs[0].logprobs[0] for o in LLM(model=path, **engine_kwargs).generate(_workload(), sp, use_tqdm=False)]
    for kv, bound in (("bfloat16", 0.06), ("int8", 0.12), ("float8_e4m3fn", 0.8)):
        got = [o.outputs[0].logprobs[0] for o in LLM(model=path, **engine_kwargs, kv_cache_dtype=kv).generate(
            _workload(), sp, use_tqdm=False)]
        delta = [abs(a[max(a, key=a.get)] - b.get(max(a, key=a.get), -1e9)) for a, b in zip(ref, got)]
        assert 0 < np.mean(delta) < bound, (kv, delta)  # > 0: the pool really is narrow


def test_pool_layout_and_sizing(tiny_models, engine_kwargs):
    path = tiny_models["llama"]
    kw = {**engine_kwargs, "max_num_seqs": 64, "max_model_len": 512, "kv_cache_memory_gb": 0.0005,
          "warmup": False}
    blocks, kv_bytes = {}, {}
    for kv in ("auto", "bfloat16", "int8"):
        eng = LLM(model=path, **kw, kv_cache_dtype=kv).engine
        k = eng.runner.k_pool
        blocks[kv], kv_bytes[kv] = eng.num_blocks, eng.runner.memory_per_device()["kv_bytes_per_device"]
        if kv == "int8":
            assert isinstance(k, QuantPool) and k.values.dtype == jnp.int8 and k.scale.dtype == jnp.float32
            assert k.scale.shape == k.values.shape[:3]  # [L*N, bs, Hkv]: one scale per token per KV head
        else:
            assert k.dtype == {"auto": jnp.float32, "bfloat16": jnp.bfloat16}[kv]
    hd = 16  # the tiny llama: hidden 64, 4 heads
    per_token = {"auto": 4 * hd, "bfloat16": 2 * hd, "int8": hd + 4}
    for kv in per_token:  # the same memory holds more blocks, as many as the bytes per token allow
        assert abs(blocks[kv] / blocks["auto"] - per_token["auto"] / per_token[kv]) < 0.02, blocks
        assert kv_bytes[kv] <= 0.0005 * 2 ** 30
        assert kv_bytes[kv] / blocks[kv] == kv_bytes["auto"] / blocks["auto"] * per_token[kv] / per_token["auto"]


def test_failed_step_rebuilds_quantized_pool(tiny_models, engine_kwargs):
    prompts = _prompts()
    want = _tokens(LLM(model=tiny_models["llama"], **engine_kwargs, kv_cache_dtype="int8"),
                   [{"prompt_token_ids": p} for p in prompts], FAILURE_GREEDY)  # the sampling `run` uses
    engine = LLMEngine(EngineConfig(model=tiny_models["llama"], **engine_kwargs, kv_cache_dtype="int8"))
    real, calls = engine.runner.execute, []

    def execute(out):
        calls.append(1)
        if len(calls) == 4:  # a failed donated call lost part of the pool: only the scales here
            engine.runner.k_pool.scale.delete()
            engine.runner.v_pool.scale.delete()
            raise RuntimeError("injected failure")
        return real(out)
    engine.runner.execute = execute
    try:
        done = run(engine, [(str(i), p) for i, p in enumerate(prompts)], small_budget_at=4)
    finally:
        del engine.runner.execute
    failed = [i for i in range(len(prompts)) if done[str(i)].outputs[0].finish_reason == "error"]
    assert 0 < len(failed) < len(prompts)
    k = engine.runner.k_pool
    assert isinstance(k, QuantPool) and not k.scale.is_deleted() and k.values.dtype == jnp.int8
    for i in set(range(len(prompts))) - set(failed):  # recomputed on the rebuilt pool
        assert done[str(i)].outputs[0].token_ids == want[i], i
    assert_all_free(engine)


@pytest.mark.parametrize("bad", ["fp8", "float32", "int4", None])
def test_bad_kv_cache_dtype(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=bad)


def test_cli_flag(tiny_models, monkeypatch):
    """--kv-cache-dtype of `generate` and `serve` reaches the engine's config."""
    import jaxpaged
    import jaxpaged.parallel.replicas
    from jaxpaged.cli import main
    seen = {}

    def fake_llm(**kw):
        seen["generate"] = kw["kv_cache_dtype"]
        raise ValueError("stop here")

    def fake_build(cfg):
        seen["serve"] = cfg.kv_cache_dtype  # returning None: as a multi-host follower, the server exits
    monkeypatch.setattr(jaxpaged, "LLM", fake_llm)
    monkeypatch.setattr(jaxpaged.parallel.replicas, "build_engine", fake_build)
    assert main(["generate", "--prompt", "x", "--model", tiny_models["llama"], "--kv-cache-dtype", "int8"]) == 2
    assert main(["serve", "--model", tiny_models["llama"], "--kv-cache-dtype", "float8_e4m3fn"]) == 0
    assert seen == {"generate": "int8", "serve": "float8_e4m3fn"}
    with pytest.raises(SystemExit):  # argparse rejects an unknown value
        main(["generate", "--prompt", "x", "--kv-cache-dtype", "fp4"])
