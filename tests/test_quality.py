"""Quality goal of weight-only int8 (issue 14): on the default model's golden prompts, teacher-forced on
the float32 run's tokens, the mean |delta logprob| of those tokens stays under the goal
(jaxpaged/bench/quality.py measures it; docs/benchmarks.md has the figures)."""
import pytest

pytestmark = pytest.mark.slow


def test_int8_weights_within_goal(compile_cache):
    from jaxpaged.bench import quality
    out = quality.main(["--weights", "float32", "int8", "--max-tokens", "16", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "128", "--no-warmup",  # the buckets used, not all
                        "--compilation-cache-dir", compile_cache])
    rows = {r["weights"]: r for r in out["rows"]}
    assert out["prompts"] == 7 and rows["int8"]["positions"] == 7 * 16
    assert rows["float32"]["mean_abs_dlogprob"] == 0 and rows["float32"]["greedy_agreement"] == 1
    assert rows["int8"]["mean_abs_dlogprob"] <= quality.GOAL_INT8_WEIGHTS, rows["int8"]
    # issue 44's bound for int8's default (groups of 32 with a minimum; int16 activations on the kernel)
    assert rows["int8"]["mean_abs_dlogprob"] <= quality.GOAL_INT8_DEFAULT, rows["int8"]
    assert rows["int8"]["greedy_agreement"] >= 0.9, rows["int8"]
