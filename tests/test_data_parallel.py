"""Data parallelism: DP in {1, 2} and TP x DP = 2 x 2 give the same greedy tokens (through preemption,
chunked prefill and prefix hits); routing keeps a shared first block on one replica until that replica is
overloaded; stats per replica and their sum, and /metrics per replica.

The engines run in a subprocess (this file run as a script), since the simulated device count must be
set before JAX starts."""
import json
import os
import subprocess
import sys

import pytest

from jaxpaged.testing.xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow
CONFIGS = [(1, 1), (2, 1), (2, 2)]  # (data_parallel_size, tensor_parallel_size)
BLOCK, BUDGET = 16, 32


def prompts() -> list[list[int]]:
    """Mixed lengths (1 to 61 tokens: chunked at a 32-token budget), two sharing 2 full blocks."""
    ps = [[(i * 7 + j * 13) % 250 + 3 for j in range(1 + 12 * i)] for i in range(6)]
    return ps + [ps[4][:40] + [9, 8, 7], ps[4][:33]]


def worker(model_dir: str, cache: str) -> dict:
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.checkpoints.weights import read_safetensors, safetensors_files
    from jaxpaged.parallel.replicas import AFFINITY_SLACK_STEPS
    from serve.metrics import Metrics
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=BUDGET, max_model_len=128,
              block_size=BLOCK, num_kv_blocks=9, compilation_cache_dir=cache, show_progress=False)
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    out = {"tokens": {}, "stats": {}}
    for dp, tp in CONFIGS:
        llm = LLM(model_dir, data_parallel_size=dp, tensor_parallel_size=tp, **kw)
        out["tokens"][f"{dp}x{tp}"] = [o.outputs[0].token_ids for o in llm.generate(prompts(), sp, use_tqdm=False)]
        out["stats"][f"{dp}x{tp}"] = llm.stats()
        out["metrics"] = Metrics(llm.engine, "tiny").render()[0].decode()
        # the same weight update (layer 0's MLP scaled, by HF names) reaches every replica
        pairs = [(n, a * 1.5 if n.startswith("model.layers.0.mlp.") else a)
                 for f in safetensors_files(model_dir) for n, a in read_safetensors(f)]
        llm.update_weights(pairs)
        out.setdefault("updated", {})[f"{dp}x{tp}"] = [
            o.outputs[0].token_ids for o in llm.generate(prompts(), sp, use_tqdm=False)]
    # routing on the last (2 x 2) engine, idle now
    eng, p = llm.engine, prompts()[4]
    big = SamplingParams(max_tokens=60, temperature=0)
    route = {}
    route["a"] = eng.replica_of(eng.add_request("a", p, big))
    route["b_same_block"] = eng.replica_of(eng.add_request("b", p[:BLOCK] + [1, 2, 3], big))
    route["c_other"] = eng.replica_of(eng.add_request("c", [5] * 20, big))
    # load the affinity replica until it is more than the slack ahead of the other one
    n, slack = 0, AFFINITY_SLACK_STEPS * BUDGET
    while True:
        load = [eng.outstanding_tokens(e) for e in eng.engines]
        if load[route["a"]] > load[1 - route["a"]] + slack:
            break
        eng.add_request(f"fill{n}", p[:BLOCK] + [n + 1], big)
        n += 1
    route["d_overloaded"] = eng.replica_of(eng.add_request("d", p[:BLOCK] + [4], big))
    try:
        eng.add_request("c", [5] * 3, big)
    except ValueError as e:
        route["duplicate_id_error"] = str(e)
    for rid in ["a", "b", "c", "d"] + [f"fill{i}" for i in range(n)]:
        eng.abort_request(rid)
    route["unfinished_after_abort"] = [e.has_unfinished_requests() for e in eng.engines]
    out["route"] = route
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory, compile_cache):
    from jaxpaged.testing.tiny_models import make_tiny_model
    d = make_tiny_model(str(tmp_path_factory.mktemp("dp_model")), "llama", num_heads=8, num_kv_heads=4,
                        hidden_size=64)
    env = {**subprocess_env(4), "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, __file__, d, compile_cache], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", [f"{dp}x{tp}" for dp, tp in CONFIGS[1:]])
def test_same_tokens_as_one_replica(result, config):
    ref = result["tokens"]["1x1"]
    assert [len(t) for t in ref] == [14] * len(prompts())
    assert result["tokens"][config] == ref


def test_update_weights_on_every_replica(result):
    upd = result["updated"]
    assert upd["1x1"] != result["tokens"]["1x1"]
    assert all(upd[f"{dp}x{tp}"] == upd["1x1"] for dp, tp in CONFIGS)


def test_paths_exercised(result):
    for name, s in result["stats"].items():
        assert s["prefix_cache_hit_rate"] > 0, name            # the shared prompts hit the cache
    for name, s in result["stats"].items():
        assert s["num_preemptions"] > 0, name                   # 8 blocks for 4 slots of up to 5 blocks


def test_stats_per_replica_and_sum(result):
    for dp, tp in CONFIGS[1:]:
        s = result["stats"][f"{dp}x{tp}"]
        reps = s["replicas"]
        assert s["data_parallel_size"] == dp == len(reps)
        for k in ("kv_blocks_total", "kv_blocks_free", "num_preemptions", "num_running", "num_compilations"):
            assert s[k] == sum(r[k] for r in reps), k
        assert s["kv_blocks_total"] == dp * 8 and s["tensor_parallel_size"] == tp
        assert all(r["num_running"] == r["num_waiting"] == 0 for r in reps)
        assert min(r["prefix_cache_hit_rate"] for r in reps) < s["prefix_cache_hit_rate"] \
            <= max(r["prefix_cache_hit_rate"] for r in reps)  # both replicas served (one got the prefix pair)


def test_metrics_carry_a_replica_label(result):
    """/metrics of the 2 x 2 engine: one preemption sample per replica, each that replica's count."""
    lines = [ln for ln in result["metrics"].splitlines() if ln.startswith("jaxpaged:num_preemptions_total")]
    reps = result["stats"]["2x2"]["replicas"]
    assert sorted(lines) == sorted(f'jaxpaged:num_preemptions_total{{engine="{i}",model_name="tiny",replica="{i}"}} '
                                   f'{float(r["num_preemptions"])}' for i, r in enumerate(reps))


def test_routing(result):
    r = result["route"]
    assert r["b_same_block"] == r["a"]              # same first block -> same replica (prefix affinity)
    assert r["c_other"] != r["a"]                   # otherwise the least loaded one
    assert r["d_overloaded"] != r["a"]              # affinity yields to an overloaded replica
    assert "already in use" in r["duplicate_id_error"]
    assert r["unfinished_after_abort"] == [False, False]  # aborts reached the owning replicas


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], sys.argv[2])))
