"""Expert parallelism on simulated CPU devices: Mixtral's experts split over 2 and 4 devices with
`param_partition_specs` give one device's logits, and the expert weights are never gathered.

Runs in a subprocess: the device count must be set before JAX starts. (The engine's mesh wiring is
another issue's; this checks the specs and the pure model function under them.)"""
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, sys.argv[2])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxpaged import ModelConfig
from jaxpaged.attention import make_attention
from jaxpaged.models.llama import forward
from jaxpaged.weights import load_params, param_partition_specs
from models import make_tiny_model
path = make_tiny_model(sys.argv[1], "mixtral", seed=14)
cfg = ModelConfig.from_dir(path)
params = load_params(path, cfg, "float32")
rng = np.random.default_rng(0)
T, bs, N = 16, 4, 12
batch = dict(input_ids=jnp.asarray(rng.integers(3, 256, T), jnp.int32),
             positions=jnp.asarray(np.r_[np.arange(8), np.arange(8)], jnp.int32),
             slot_mapping=jnp.asarray(np.r_[np.arange(8) + 4, np.arange(8) + 24], jnp.int32),
             block_tables=jnp.asarray([[1, 2, 0], [6, 7, 0]], jnp.int32), seq_lens=jnp.asarray([8, 8], jnp.int32),
             query_start_loc=jnp.asarray([0, 8, 16], jnp.int32), logits_indices=jnp.asarray([7, 15], jnp.int32))
pool = jnp.zeros((cfg.num_layers * N, bs, cfg.num_kv_heads, cfg.head_dim))
f = jax.jit(lambda p, k, v, b: forward(p, cfg, k, v, b, make_attention("reference", False))[0])
want = np.asarray(f(jax.tree.map(jnp.asarray, params), pool, pool, batch))
specs = param_partition_specs(cfg, "model")
for n in (2, 4):
    mesh = Mesh(np.array(jax.devices()[:n]), ("model",))
    experts = ("w_gate", "w_up", "w_down")  # only the experts split: 2 KV heads do not divide 4 devices
    sp = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in params.items() if k != "layers"}
    sp["layers"] = {k: jax.device_put(v, NamedSharding(mesh, specs["layers"][k] if k in experts else P()))
                    for k, v in params["layers"].items()}
    assert sp["layers"]["w_up"].addressable_shards[0].data.shape[1] == cfg.num_experts // n
    got = np.asarray(f(sp, pool, pool, batch))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    hlo = f.lower(sp, pool, pool, batch).compile().as_text()
    gathered = [l for l in hlo.splitlines() if "all-gather(" in l and "f32[" in l.split("all-gather(")[0]]
    assert not gathered, gathered  # no float tensor (expert weights) is all-gathered
print("ok")
'''


@pytest.mark.slow
def test_experts_split_over_simulated_devices(tmp_path):
    tests = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "mixtral"), tests], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
