"""KV cache quality on the default model (SmolLM2-135M) against its float32-KV self, teacher-forced on the
float32 run's greedy tokens over the golden prompts (jaxpaged/testing/prompts.py): the issue's goals, mean
|delta logprob| of the chosen tokens <= 0.005 (bfloat16 KV) and <= 0.02 (int8 KV). Each engine scores the 7
prompts' 224 positions by prompt logprobs: one request per prompt, not one per position."""
import pytest

pytestmark = pytest.mark.slow


def test_kv_cache_quality_goals(compile_cache):
    from jaxpaged.bench import quality
    out = quality.main(["--weights", "float32", "--kv", "auto", "bfloat16", "int8", "--max-tokens", "32",
                        "--max-num-seqs", "8", "--max-num-batched-tokens", "128",  # the 7 prompts, fewer buckets
                        "--no-warmup",  # each engine compiles the buckets its requests take, not all five
                        "--compilation-cache-dir", compile_cache])
    res = {r["kv_cache_dtype"]: r for r in out["rows"]}
    assert res["bfloat16"]["positions"] == out["prompts"] * 32
    assert res["auto"]["mean_abs_dlogprob"] == 0 and res["auto"]["greedy_agreement"] == 1
    for kv, goal in quality.GOAL_KV.items():
        assert res[kv]["mean_abs_dlogprob"] <= goal, res
    assert res["bfloat16"]["greedy_agreement"] >= 0.97 and res["int8"]["greedy_agreement"] >= 0.95, res
    assert 0 < res["bfloat16"]["mean_abs_dlogprob"] < res["int8"]["mean_abs_dlogprob"]  # narrower, further
