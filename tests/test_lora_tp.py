"""LoRA with tensor parallelism (2 and 4 simulated CPU devices; 4 repeats the tiny model's 2 KV heads):
A and B split like their base weights, and the same tokens and logprobs as one device."""
import json
import os
import subprocess
import sys

import pytest
from lora_adapters import make_adapter

from jaxpaged.testing.tiny_models import make_tiny_model
from jaxpaged.testing.xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp")
    base = make_tiny_model(str(root / "base"), "llama", seed=5, num_heads=4, num_kv_heads=2)
    adapters = [make_adapter(str(root / f"a{j}"), base, r=r, alpha=2.0 * r, seed=40 + j) for j, r in enumerate((4, 8))]
    env = {**subprocess_env(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "lora_tp_checks.py"), base, *adapters],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["num_devices"] == 4
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tokens_and_logprobs_equal_tp1(facts, tp):
    one, many = facts["1"], facts[str(tp)]
    assert many["tokens"] == one["tokens"]
    for a, b in zip(one["logprobs"], many["logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert many["num_compilations"] == many["num_buckets"]


@pytest.mark.parametrize("tp", [2, 4])
def test_slots_split_like_base(facts, tp):
    """Column-parallel targets split B's out axis, row-parallel ones (o, down) A's in axis (8 slots' shape:
    [L, max_loras + 1, in, R] / [L, max_loras + 1, R, out], tiny model D=64, F=128, 4 heads of 16)."""
    s = facts[str(tp)]["shards"]
    assert s["a/wq"] == [2, 3, 64, 8] and s["b/wq"] == [2, 3, 8, 64 // tp]
    assert s["a/wo"] == [2, 3, 64 // tp, 8] and s["b/wo"] == [2, 3, 8, 64]
    assert s["a/w_down"] == [2, 3, 128 // tp, 8] and s["b/w_up"] == [2, 3, 8, 128 // tp]
    assert s["b/wk"] == [2, 3, 8, 16 * max(2, tp) // tp]  # 2 KV heads, repeated to one per device at TP=4
