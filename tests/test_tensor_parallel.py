"""Tensor parallelism: the same tokens, logits and samples as one device, 1/N of the bytes per device, the
pool donated and never gathered. Multi-device checks run on 8 simulated CPU devices in one subprocess
(tests/tensor_parallel_checks.py: the device count is fixed when JAX starts); validation runs here."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpaged.checkpoints.weights import param_shapes
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.step.mesh import (
    device_groups,
    kv_head_replication,
    make_mesh,
    param_partition_specs,
    replicate_kv_heads,
    sharded_model_config,
)
from jaxpaged.testing.xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPS = (1, 2, 4)


def _checks(workdir, *only) -> dict:
    env = {**subprocess_env(8), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "tensor_parallel_checks.py"),
                           str(workdir), *only], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["num_devices"] == 8
    return out


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    return _checks(tmp_path_factory.mktemp("tp"))


@pytest.mark.slow
def test_int8_kv_cache(facts):
    """int8 KV pools split by KV head with their scales: the same tokens at TP 1, 2, 4 through preemption,
    chunked prefill and prefix hits, and the Pallas kernels under shard_map agree with the reference."""
    f = facts["kv_int8"]
    for name, hkv in (("llama_8q4kv", 4), ("qwen3_8q2kv", 2)):
        one = f[f"{name}_tp1"]
        assert one["num_preemptions"] > 0 and one["prefix_cache_hit_rate"] > 0
        for tp in TPS:
            r = f[f"{name}_tp{tp}"]
            assert r["greedy"] == one["greedy"], (name, tp)
            local = max(hkv, tp) // tp  # KV heads per device (replicated when fewer than devices)
            assert r["values_local"][2] == local and r["scale_local"] == r["values_local"][:3], (name, tp, r)
            assert r["scale_devices"] == tp
    p = f["pallas_tp2"]
    assert p["decode_variant_used"] and p["tokens"] == [t[:8] for t in f["llama_8q4kv_tp1"]["greedy"][:3]]


MODELS = ("llama_8q4kv", "qwen3_8q2kv")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_tokens_equal_tp1_through_engine_paths(facts, model):
    f = facts[model]
    assert f["tp1"]["num_preemptions"] > 0 and f["tp1"]["prefix_cache_hit_rate"] > 0  # the paths ran
    for tp in TPS[1:]:
        assert f[f"tp{tp}"]["tensor_parallel_size"] == tp
        assert f[f"tp{tp}"]["greedy"] == f["tp1"]["greedy"], tp
        assert f[f"tp{tp}"]["seeded"] == f["tp1"]["seeded"], tp
        np.testing.assert_allclose(np.concatenate(f[f"tp{tp}"]["seeded_logprobs"]),
                                   np.concatenate(f["tp1"]["seeded_logprobs"]), atol=1e-4)
        assert f[f"tp{tp}"]["num_compilations"] == f[f"tp{tp}"]["num_buckets"]  # one per bucket, no more
    assert f["tp1"]["devices"] == [0] and f["tp4"]["devices"] == [0, 1, 2, 3]
    assert f["tp2"]["devices"] == [6, 7]  # LLMEngine(config, devices=jax.devices()[-2:])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_logits_close_to_tp1(facts, model):
    d = facts[model]["logits_rel_diff"]
    assert d["tp1"] == 0.0
    assert d["tp2"] < 1e-5 and d["tp4"] < 1e-5, d


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_bytes_per_device_shrink(facts, model):
    f = facts[model]
    hkv = {"llama_8q4kv": 4, "qwen3_8q2kv": 2}[model]
    p1, kv1 = f["tp1"]["param_bytes_per_device"], f["tp1"]["kv_bytes_per_device"]
    for tp in TPS:
        r = f[f"tp{tp}"]
        assert r["kv_bytes_per_device"] == r["kv_bytes_formula"]
        # each device holds max(hkv, tp) / hkv copies' worth of KV heads, split tp ways
        assert r["kv_bytes_per_device"] * tp == kv1 * max(hkv, tp) // hkv
        assert r["pool_shape"][2] == max(hkv, tp)
        # norms (and replicated KV projections) keep it a little above 1/N
        assert p1 / tp <= r["param_bytes_per_device"] <= 1.1 * p1 / tp, (tp, r["param_bytes_per_device"], p1)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_hlo_pool_donated_never_moved(facts, model):
    h1 = facts[model]["tp1"]["hlo"]
    assert h1["pool_aliased"] == [True, True] and h1["pool_moves"] == [] and h1["collectives"] == []
    for tp in TPS[1:]:
        h = facts[model][f"tp{tp}"]["hlo"]
        assert h["pool_aliased"] == [True, True]
        assert h["pool_moves"] == []
        T, D = h["step_shape"]
        S, V = h["logits_shape"]
        kinds = {(k, shape) for k, shape in h["collectives"]}
        # per step: all-reduces of the residual [T, D] (after wo, w_down, the vocab-sharded embedding)
        # and one all-gather of the logits [S, V] (and of all T rows' logits [T, V], in the branch that runs
        # only when a request asks for prompt logprobs); no weight or pool ever crosses devices
        assert kinds == {("all-reduce", f"{T},{D}"), ("all-gather", f"{S},{V}"), ("all-gather", f"{T},{V}")}, \
            h["collectives"]
        assert sum(k == "all-reduce" for k, _ in h["collectives"]) >= 2


@pytest.mark.slow
def test_pallas_under_shard_map_matches_reference(facts):
    p = facts["pallas"]
    assert p["backend"] == "triton" and p["decode_variant_used"]
    assert p["pallas_tp2"] == p["reference"]


@pytest.mark.slow
def test_int8_weights_sharded_like_their_matrices(facts):
    f = facts["int8"]
    for key in ("logits_rel_diff", "logits_rel_diff_channel"):  # int8's default (groups of 32), per channel
        assert f[key]["tp2"] < 1e-5 and f[key]["tp4"] < 1e-5, (key, f[key])
    for tp in TPS[1:]:
        assert f[f"tp{tp}"]["greedy"] == f["tp1"]["greedy"], tp
        # the int8 bytes split like float ones (norms and the row-split matrices' scales are replicated)
        p1 = f["tp1"]["param_bytes_per_device"]
        assert p1 / tp <= f[f"tp{tp}"]["param_bytes_per_device"] <= 1.15 * p1 / tp
    specs = f["tp2"]["specs"]
    # q: its matrix's spec; scale: the same (groups of 32: wo's 2 groups split with its rows), int8 storage
    assert specs["wq"] == [[None, None, "model"], [None, None, "model"], "int8"]
    assert specs["wo"] == [[None, "model", None], [None, "model", None], "int8"]
    assert specs["embed"] == [["model", None], ["model", None], "int8"]


@pytest.mark.slow
def test_kv_cache_memory_is_per_device(facts):
    # 8 query / 4 KV heads: a block takes 1/N of its TP=1 bytes on each device, so N times the blocks fit
    assert facts["num_blocks_from_memory"] == {"tp1": 12, "tp2": 24, "tp4": 33}  # 33: max_num_seqs' worth


@pytest.mark.slow
def test_bad_sizes_name_the_numbers(facts):
    e = facts["errors"]
    assert e["tp3"] and "tensor_parallel_size (3)" in e["tp3"] and "num_heads (8)" in e["tp3"]
    assert e["tp16"] and "16" in e["tp16"] and "8 are available" in e["tp16"]


def _cfg(hq=8, hkv=2, hd=4, **kw):
    return ModelConfig(family="llama", vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=2,
                       num_heads=hq, num_kv_heads=hkv, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=64, **kw)


def test_kv_head_replication_rules():
    assert kv_head_replication(_cfg(8, 4), 2) == 1
    assert kv_head_replication(_cfg(8, 2), 4) == 2 and kv_head_replication(_cfg(8, 2), 8) == 4
    assert sharded_model_config(_cfg(8, 2), 8).num_kv_heads == 8
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide the model's num_heads \(8\)"):
        kv_head_replication(_cfg(8, 2), 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide the model's num_kv_heads \(6\)"):
        kv_head_replication(_cfg(12, 6), 4)
    with pytest.raises(ValueError, match=r"multiple of num_kv_heads \(4\)"):
        kv_head_replication(_cfg(12, 4, 2), 6)


def test_replicated_kv_heads_keep_gqa_grouping():
    """Query head h reads replicated KV head h // (Hq / Hkv'), which must be a copy of original h // (Hq / Hkv)."""
    cfg, tp = _cfg(8, 2, hd=4, attention_bias=True), 8
    rng = np.random.default_rng(0)
    shapes = param_shapes(cfg)["layers"]
    layers = {k: rng.standard_normal(shapes[k]).astype(np.float32) for k in ("wk", "wv", "bk", "bv", "wq")}
    r = kv_head_replication(cfg, tp)
    rep = replicate_kv_heads({"layers": layers}, cfg, r)["layers"]
    hkv2 = sharded_model_config(cfg, tp).num_kv_heads
    for name in ("wk", "wv", "bk", "bv"):
        orig = layers[name].reshape(layers[name].shape[:-1] + (2, 4))
        new = rep[name].reshape(rep[name].shape[:-1] + (hkv2, 4))
        for h in range(8):
            np.testing.assert_array_equal(new[..., h // (8 // hkv2), :], orig[..., h // (8 // 2), :])
        # each device (one KV head each at tp=8) holds the copy its query heads need
        assert new.shape[-2] % tp == 0
    assert rep["wq"] is layers["wq"]


def test_partition_specs_cover_every_parameter():
    import jax
    from jax.sharding import PartitionSpec as P
    for cfg in (_cfg(), _cfg(tie_word_embeddings=True, qk_norm="head", attention_bias=True)):
        shapes, specs = param_shapes(cfg), param_partition_specs(cfg, 2)
        assert jax.tree.structure(shapes, is_leaf=lambda x: isinstance(x, tuple)) == \
            jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P))
    assert param_partition_specs(_cfg(), 2)["embed"] == P("model", None)   # 96 % 2 == 0: vocab-sharded
    assert param_partition_specs(_cfg(), 5)["lm_head"] == P()              # 96 % 5 != 0: replicated


def test_config_and_mesh_validation():
    import jax
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n + 1} needs {n + 1} devices, but only {n}"):
        make_mesh(n + 1)
    with pytest.raises(ValueError, match=rf"needs {2 * n} devices, but only {n}"):
        device_groups(n, 2)
    mesh = make_mesh(1)
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (1, 1)
    assert device_groups(1, 1) == [[jax.devices()[0]]]


def test_cli_flags_reach_the_engine(tiny_models, capsys):
    """--tensor-parallel-size of `generate` and `serve` reaches EngineConfig: asking for more devices than
    this process has fails with the engine's message, before any weights load."""
    import jax

    from jaxpaged.cli import main
    n = len(jax.devices()) + 1
    for cmd in (["generate", "--prompt", "hi"], ["serve"]):
        assert main([*cmd, "--model", tiny_models["llama"], "--tensor-parallel-size", str(n)]) == 2
        assert f"tensor_parallel_size={n} needs {n} devices" in capsys.readouterr().err
