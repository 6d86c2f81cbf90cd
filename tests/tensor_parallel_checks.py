"""Tensor-parallel checks on 8 simulated CPU devices, run by tests/test_tensor_parallel.py in a subprocess.

`python tests/tensor_parallel_checks.py WORKDIR` (XLA_FLAGS must already hold
--xla_force_host_platform_device_count=8) prints one JSON object on its last line: the raw facts
(token lists, logit differences, byte counts, HLO findings, error messages); the test asserts on them.
JAX starts once for all of them.
"""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

TPS = (1, 2, 4)
# name -> (family, query heads, KV heads, tied embeddings); TP=4 replicates qwen3's KV heads
MODELS = {"llama_8q4kv": ("llama", 8, 4, False), "qwen3_8q2kv": ("qwen3", 8, 2, True)}


def workload():
    """Mixed prompts: short, chunked (> 16 tokens), and three sharing a 24-token prefix (3 full blocks)."""
    rng = np.random.default_rng(5)
    ids = lambda n: [int(t) for t in rng.integers(3, 256, size=n)]  # noqa: E731
    shared = ids(24)
    prompts = [ids(n) for n in (3, 17, 38, 9)] + [shared + ids(n) for n in (2, 11)] + [list(shared)]
    return [{"prompt_token_ids": p} for p in prompts]


def engine_kwargs(**over):
    kw = dict(dtype="float32", block_size=8, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              num_kv_blocks=14, compilation_cache_dir=None, show_progress=False, attention_backend="reference")
    return {**kw, **over}


def hlo_facts(runner) -> dict:
    """What the compiled mixed step of the largest bucket does with the pool, and its collectives."""
    import jax
    T = runner.buckets[-1]
    compiled = runner.compiled_step((T, False))
    text = compiled.as_text()
    n_params = len(jax.tree.leaves(runner.params))
    k_out = compiled.out_tree.num_leaves - 2  # the step's outputs end with k_pool, v_pool
    alias = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*entry", text)
    alias = alias.group(1) if alias else ""
    local = [s.data.shape for s in runner.k_pool.addressable_shards][0]
    shapes = {",".join(map(str, runner.k_pool.shape)), ",".join(map(str, local))}
    pool_re = "|".join(re.escape(s) for s in shapes)
    collectives, pool_moves = [], []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|"
                     r"collective-permute|reduce-scatter)(?:-start)?\(", line)
        if m:
            collectives.append((m.group(2), m.group(1)))
        m = re.match(rf"\s*(?:ROOT )?%(\S+) = \w+\[({pool_re})\]\S* (\w[\w-]*)\(", line)
        if m and (m.group(3) in ("copy", "all-gather", "all-to-all", "collective-permute")
                  or (m.group(3) == "fusion" and "copy" in m.group(1))):
            pool_moves.append(line.strip()[:160])
    D, S, V = runner.model_cfg.hidden_size, runner.cfg.max_num_seqs, runner.model_cfg.vocab_size
    return dict(pool_aliased=[f"{{{k_out}}}: ({n_params}," in alias, f"{{{k_out + 1}}}: ({n_params + 1}," in alias],
                pool_moves=pool_moves, collectives=collectives, step_shape=[T, D], logits_shape=[S, V])


def engine_checks(path: str, out: dict) -> None:
    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.config import EngineConfig
    from jaxpaged.engine import LLMEngine
    from jaxpaged.step.runner import kv_bytes_per_block
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=100 + i, logprobs=2,
                             ignore_eos=True) for i in range(len(workload()))]
    for tp in TPS:
        # TP=2 on the last two devices, through LLMEngine(config, devices)
        devices = jax.devices()[-2:] if tp == 2 else None
        eng = LLMEngine(EngineConfig(model=path, **engine_kwargs(tensor_parallel_size=tp)), devices)
        llm = LLM.from_engine(eng)  # LLM.generate around an engine built on chosen devices
        r = dict(greedy=[o.outputs[0].token_ids for o in llm.generate(workload(), greedy, use_tqdm=False)])
        outs = llm.generate(workload(), seeded, use_tqdm=False)
        r["seeded"] = [o.outputs[0].token_ids for o in outs]
        r["seeded_logprobs"] = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                for o in outs]
        s = llm.stats()
        r.update({k: s[k] for k in ("num_preemptions", "prefix_cache_hit_rate", "num_compilations",
                                    "num_buckets", "param_bytes_per_device", "kv_bytes_per_device",
                                    "tensor_parallel_size")})
        r["kv_bytes_formula"] = eng.num_blocks * kv_bytes_per_block(eng.model_config, 8, "float32", tp)
        r["pool_shape"] = list(eng.runner.k_pool.shape)
        r["devices"] = sorted({d.id for a in [eng.runner.k_pool, *jax.tree.leaves(eng.runner.params)]
                               for d in a.sharding.device_set})
        r["hlo"] = hlo_facts(eng.runner)
        out[f"tp{tp}"] = r


def logits_checks(path: str, quantization: str | None = None, group_size: int | None = None) -> dict:
    """The pure forward (one prefill step of two sequences) at each TP: max |logits - logits at TP=1|."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxpaged.checkpoints.weights import load_params
    from jaxpaged.config import ModelConfig
    from jaxpaged.models.llama import forward
    from jaxpaged.step.attention import make_attention
    from jaxpaged.step.mesh import POOL_SPEC, make_mesh, place_params, sharded_model_config
    mc = ModelConfig.from_dir(path)
    params = load_params(path, mc, "float32", quantization=quantization, group_size=group_size)
    lens, bs = (13, 6), 8
    T = sum(lens)
    rng = np.random.default_rng(0)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    tables = np.array([[1, 2], [3, 4]], np.int32)
    slot = np.concatenate([tables[i][np.arange(n) // bs] * bs + np.arange(n) % bs for i, n in enumerate(lens)])
    batch = dict(input_ids=rng.integers(3, mc.vocab_size, T).astype(np.int32), positions=pos,
                 slot_mapping=slot.astype(np.int32), block_tables=tables, seq_lens=np.array(lens, np.int32),
                 query_start_loc=np.array([0, lens[0], T], np.int32),
                 logits_indices=np.array([lens[0] - 1, T - 1], np.int32))
    res = {}
    for tp in TPS:
        mesh = make_mesh(tp)
        cfg = sharded_model_config(mc, tp)
        shape = (mc.num_layers * 6, bs, cfg.num_kv_heads, mc.head_dim)
        pool = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=NamedSharding(mesh, POOL_SPEC))()
        fn = jax.jit(lambda p, kp, vp, b: forward(p, cfg, kp, vp, b, make_attention("reference", False, mesh))[0])
        res[tp] = np.asarray(fn(place_params(params, mc, mesh), pool, pool, batch))
    scale = float(np.abs(res[1]).max())
    return {f"tp{tp}": float(np.abs(res[tp] - res[1]).max()) / scale for tp in TPS}


def pallas_checks(workdir: str) -> dict:
    """Pallas kernels (interpret mode) under shard_map at TP=2 against the reference backend at TP=1."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.testing.tiny_models import make_tiny_model
    path = make_tiny_model(os.path.join(workdir, "pallas_llama"), "llama", num_heads=8, num_kv_heads=4,
                           head_dim=16, seed=3)
    prompts = workload()[:3]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    kw = engine_kwargs(num_kv_blocks=40, warmup=False)
    want = LLM(model=path, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=path, **{**kw, "attention_backend": "pallas", "tensor_parallel_size": 2})
    got = llm.generate(prompts, params, use_tqdm=False)
    return dict(reference=[o.outputs[0].token_ids for o in want], pallas_tp2=[o.outputs[0].token_ids for o in got],
                backend=llm.stats()["attention_backend"],
                decode_variant_used=any(key[1] for key in llm.engine.runner._compiled))


def int8_checks(workdir: str) -> dict:
    """int8 weights (tied embedding, KV heads replicated at TP=4): greedy tokens and logits at each TP
    against TP=1, bytes per device, and where each scale lives (the spec of its matrix, minus the
    reduced axis)."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.testing.tiny_models import make_tiny_model
    path = make_tiny_model(os.path.join(workdir, "int8_qwen3"), "qwen3", num_heads=8, num_kv_heads=2,
                           head_dim=8, tie=True, seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # int8's default groups of 32: wo's 64 rows are 2 groups, split at TP=2, replicated at TP=4
    out = {"logits_rel_diff": logits_checks(path, "int8"), "logits_rel_diff_channel": logits_checks(path, "int8", 0)}
    for tp in TPS:
        llm = LLM(model=path, **engine_kwargs(tensor_parallel_size=tp, quantization="int8", matmul_backend="xla",
                                                   warmup=False))  # XLA's product at every TP: QArray leaves
        layers, embed = llm.engine.runner.params["layers"], llm.engine.runner.params["embed"]
        out[f"tp{tp}"] = dict(
            greedy=[o.outputs[0].token_ids for o in llm.generate(workload(), greedy, use_tqdm=False)],
            param_bytes_per_device=llm.stats()["param_bytes_per_device"],
            specs={name: [list(a.q.sharding.spec), list(a.scale.sharding.spec), str(a.q.dtype)]
                   for name, a in (("wq", layers["wq"]), ("wo", layers["wo"]), ("embed", embed))})
    return out


def kv_int8_checks(workdir: str) -> dict:
    """int8 KV under tensor parallelism: greedy tokens through the forced paths at
    TP 1, 2, 4 (qwen3's 2 KV heads replicated at TP 4, their scales with them), the scale pools' local
    shards, and the Pallas kernels (interpret mode) under shard_map at TP 2 against the reference at TP 1."""
    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.testing.tiny_models import make_tiny_model
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {}
    for name, (family, hq, hkv, tie) in MODELS.items():
        path = make_tiny_model(os.path.join(workdir, f"int8_{name}"), family, num_heads=hq, num_kv_heads=hkv,
                               head_dim=16, tie=tie, seed=hkv)
        for tp in TPS:
            llm = LLM(model=path, **engine_kwargs(tensor_parallel_size=tp, kv_cache_dtype="int8", warmup=False))
            r = dict(greedy=[o.outputs[0].token_ids for o in llm.generate(workload(), greedy, use_tqdm=False)])
            k = llm.engine.runner.k_pool
            r["values_local"] = list(k.values.addressable_shards[0].data.shape)
            r["scale_local"] = list(k.scale.addressable_shards[0].data.shape)
            r["scale_devices"] = len(k.scale.sharding.device_set)
            r.update({s: llm.stats()[s] for s in ("num_preemptions", "prefix_cache_hit_rate")})
            out[f"{name}_tp{tp}"] = r
        if name == "llama_8q4kv":
            kw = engine_kwargs(num_kv_blocks=40, warmup=False, kv_cache_dtype="int8")
            llm = LLM(model=path, **{**kw, "attention_backend": "pallas", "tensor_parallel_size": 2})
            out["pallas_tp2"] = dict(
                tokens=[o.outputs[0].token_ids for o in llm.generate(workload()[:3], greedy, use_tqdm=False)],
                decode_variant_used=any(key[1] for key in llm.engine.runner._compiled))
    out["num_devices"] = len(jax.devices())
    return out


def sizing_checks(path: str) -> dict:
    """Blocks the engine sizes from kv_cache_memory_gb (per device) at each TP; no step is compiled."""
    from jaxpaged.config import EngineConfig, ModelConfig
    from jaxpaged.engine import LLMEngine
    from jaxpaged.step.runner import kv_bytes_per_block
    per_block = kv_bytes_per_block(ModelConfig.from_dir(path), 8, "float32")
    gb = 12 * per_block / 2 ** 30  # 12 blocks at TP=1
    return {f"tp{tp}": LLMEngine(EngineConfig(model=path, **engine_kwargs(
        num_kv_blocks=None, kv_cache_memory_gb=gb, warmup=False, tensor_parallel_size=tp))).num_blocks
        for tp in TPS}


def error_checks(path: str) -> dict:
    from jaxpaged import LLM
    msgs = {}
    for name, tp in (("tp3", 3), ("tp16", 16)):
        try:
            LLM(model=path, **engine_kwargs(tensor_parallel_size=tp))
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


def spec_checks(workdir: str) -> dict:
    """Speculative decoding at DP 2 x TP 2 (each replica on 2 devices): the plain TP=1 tokens (greedy and seeded), the
    proposals being the plain continuation with every third one wrong (accepted runs and rejections), or a
    draft model's (the target itself, sharded like it)."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.testing.tiny_models import make_tiny_model
    path = make_tiny_model(os.path.join(workdir, "spec"), "llama", num_heads=8, num_kv_heads=4, head_dim=8, seed=4)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=7, logprobs=1, presence_penalty=0.5, ignore_eos=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    plain = LLM(model=path, **engine_kwargs(warmup=False))
    truth = [{tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain.generate(workload(), p, use_tqdm=False)}
             for p in params]

    class Oracle:
        table: dict = {}

        def propose(self, req, k):
            o, out = req.num_output_tokens, self.table.get(tuple(req.prompt_token_ids), [])
            return [t if (o + j) % 3 != 2 else (t + 1) % 256 for j, t in enumerate(out[o:o + k])]

        def retain(self, ids):
            pass

    class Always:
        def allow_larger(self, *a):
            return True

        def record(self, *a):
            pass

    out = {"plain": [list(t.values()) for t in truth]}
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}  # the target as its own draft
    for name, sc in (("dp2tp2", spec), ("draft_dp2tp2", draft)):
        llm = LLM(model=path, **engine_kwargs(speculative_config=sc, tensor_parallel_size=2, data_parallel_size=2,
                                              warmup=False))
        engines = getattr(llm.engine, "engines", [llm.engine])
        for e in engines:
            e.spec.governor = Always()
            if sc is spec:
                e.spec.proposer = Oracle()
        got = []
        for p, t in zip(params, truth):
            Oracle.table = t
            got.append([o.outputs[0].token_ids for o in llm.generate(workload(), p, use_tqdm=False)])
        out[name] = dict(tokens=got, accepted=sum(e.spec.num_accepted_tokens for e in engines),
                         drafted=sum(e.spec.num_draft_tokens for e in engines),
                         replicas_used=sum(e.spec.num_drafts > 0 for e in engines))
    return out


def main() -> None:
    workdir = sys.argv[1]
    only = set(sys.argv[2:])
    import jax

    from jaxpaged.testing.tiny_models import make_tiny_model
    out = {"num_devices": len(jax.devices())}
    for name, (family, hq, hkv, tie) in MODELS.items():
        if only and name not in only:
            continue
        path = make_tiny_model(os.path.join(workdir, name), family, num_heads=hq, num_kv_heads=hkv, head_dim=8,
                               tie=tie, seed=hkv)
        out[name] = {}
        engine_checks(path, out[name])
        out[name]["logits_rel_diff"] = logits_checks(path)
        if name == "llama_8q4kv":
            out["errors"] = error_checks(path)
            out["num_blocks_from_memory"] = sizing_checks(path)
    if not only or "pallas" in only:
        out["pallas"] = pallas_checks(workdir)
    if not only or "int8" in only:
        out["int8"] = int8_checks(workdir)
    if not only or "kv_int8" in only:
        out["kv_int8"] = kv_int8_checks(workdir)
    if "spec" in only:  # its own run (tests/test_spec_compose.py::test_tensor_and_data_parallel)
        out["spec"] = spec_checks(workdir)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
