"""JaxpagedRollout (jaxpaged/rl/tunix_rollout.py) against Tunix on tiny random Tunix Llama 3, Qwen3, Qwen2 and
Gemma 3 models (float32): greedy tokens (checked against the Tunix model's own forward), per-token logps (Tunix's
trainer path, `VanillaRollout.get_per_token_logps`), seeded sampling, weight sync, and real GRPO runs of Tunix
(`GRPOLearner` over an `RLCluster` whose rollout engine is JaxpagedRollout), full parameters and qwix LoRA.

The greedy reference is Tunix's model itself, one forward over prompt + generated tokens: Tunix
0.1.7's vanilla `Sampler` returns tokens that are not the model's argmax on these models (e.g. [0, 1, 0, 5]
where the model's own forward gives 214 first), so it cannot be the reference here."""
import functools

import numpy as np
import pytest

pytest.importorskip("tunix.rl.rollout.base_rollout")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from tunix.generate import utils as tunix_utils  # noqa: E402
from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen2 import model as qwen2  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.rl.rollout.vanilla_rollout import VanillaRollout  # noqa: E402

from jaxpaged.rl.tunix_rollout import JaxpagedRollout, to_engine_params  # noqa: E402
from jaxpaged.testing.sampled import filtered_softmax, tv, tv_bound  # noqa: E402
from jaxpaged.testing.tiny_models import add_tiny_tokenizer  # noqa: E402

PROMPTS = ["The quick brown fox", "Hello world!", "Paged attention stores keys", "café"]
SIZES = dict(num_layers=2, vocab_size=320, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2,
             rope_theta=10000, norm_eps=1e-6)
GEN = 12


# Gemma 3: a sliding layer and a global one (Tunix's model builds its layers from its module's cycle of kinds, 5
# sliding + 1 global, set here to 1 + 1 for the test: two layers, not six, to compile), a window of 8 (prompt +
# generation is longer), the global layer with its own RoPE base and a linear scale factor, the query scaled by
# 1/sqrt(embed_dim / heads) (16, not head_dim 32)
GEMMA3 = dict(num_layers=2, num_embed=320, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=32, num_kv_heads=2,
              sliding_window_size=8, local_base_frequency=10_000, global_base_frequency=1_000_000,
              global_scale_factor=8.0, param_dtype=jnp.float32,
              query_pre_attn_norm=gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS)
GEMMA3_PATTERN = (gemma3.AttentionType.LOCAL_SLIDING, gemma3.AttentionType.GLOBAL)
FAMILIES = ["llama3", "qwen3", "qwen2", "gemma3"]


def tiny_tunix_model(family: str, seed: int = 0) -> nnx.Module:
    """A Tunix model with peaked logits: matrices and embeddings redrawn with std 0.3 (Llama 3 / Qwen3 norms stay
    ones); Qwen2's q/k/v biases and Gemma 3's norm scales (zeros) get noise of std 0.3 too, so their mapping
    counts; Gemma 3's embeddings std 0.05 and its final norm a gain of ~10."""
    if family == "gemma3":
        cycle, gemma3.GEMMA3_ATTENTION_PATTERN = gemma3.GEMMA3_ATTENTION_PATTERN, GEMMA3_PATTERN
        try:
            m = gemma3.Gemma3(gemma3.ModelConfig(**GEMMA3), rngs=nnx.Rngs(seed))
        finally:
            gemma3.GEMMA3_ATTENTION_PATTERN = cycle
        assert [layer.attn.attn_type for layer in m.layers] == list(GEMMA3_PATTERN)
    else:
        module, cls = {"llama3": (llama3, llama3.Llama3), "qwen3": (qwen3, qwen3.Qwen3),
                       "qwen2": (qwen2, qwen2.Qwen2)}[family]
        m = cls(module.ModelConfig(**SIZES), rngs=nnx.Rngs(seed))
    state = nnx.state(m, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    vectors = family in ("qwen2", "gemma3")
    leaves = [0.3 * jax.random.normal(k, a.shape, a.dtype) if a.ndim >= 2
              else a + 0.3 * jax.random.normal(k, a.shape, a.dtype) if vectors else a
              for k, a in zip(keys, leaves)]
    nnx.update(m, jax.tree_util.tree_unflatten(treedef, leaves))
    if family == "gemma3":  # embeddings times sqrt(64) = 8 and tied: at std 0.3 the logits echo the input token
        m.embedder.input_embedding.value = m.embedder.input_embedding.value / 6  # std 0.05
        m.final_norm.scale.value = m.final_norm.scale.value + 9.0  # peaked logits again (a gain of ~10)
    return m


@nnx.jit
def _logits(model, ids):
    B, T = ids.shape
    return model(ids, jnp.broadcast_to(jnp.arange(T), (B, T)), None, jnp.tril(jnp.ones((B, T, T), bool)))[0]


def tunix_argmax(model, tok, prompts: list[str], tokens: list[list[int]]) -> list[np.ndarray]:
    """The Tunix model's argmax after each prefix of prompt (BOS + encoding, as the sampler) + tokens, from one
    jitted forward over the batch, right-padded to 32 (causal: the padding changes no earlier position):
    [len(tokens) + 1] per prompt."""
    ids = [[tok.bos_token_id] + tok.encode(p) for p in prompts]
    seqs = np.zeros((len(prompts), 32), np.int32)
    for i, (a, t) in enumerate(zip(ids, tokens)):
        seqs[i, :len(a) + len(t)] = a + list(t)
    best = np.asarray(np.argmax(_logits(model, seqs), -1))
    return [best[i, len(a) - 1:len(a) + len(t)] for i, (a, t) in enumerate(zip(ids, tokens))]


def assert_tunix_greedy(model, tok, prompts: list[str], tokens: list[list[int]], n: int, eos: int) -> None:
    """`tokens[i]` is the Tunix model's greedy continuation of `prompts[i]`: each token the argmax after its
    prefix, and the last argmax EOS unless n tokens were generated."""
    for best, t in zip(tunix_argmax(model, tok, prompts, tokens), tokens):
        assert best[:len(t)].tolist() == list(t)
        assert len(t) == n or best[len(t)] == eos


def rollout_config(**kw) -> base_rollout.RolloutConfig:
    return base_rollout.RolloutConfig(**{**dict(max_tokens_to_generate=GEN, max_prompt_length=16,
                                                temperature=0.0, kv_cache_size=64), **kw})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tunix_tok"))
    add_tiny_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tokenizer, compile_cache):
    """(model, jaxpaged rollout, vanilla rollout) of one family."""
    model = tiny_tunix_model(request.param)
    # Llama 3 and Qwen3 compile every step shape at start-up (the GRPO runs below reuse them from the cache); the
    # other families compile only the shapes the tests use, the same ones each time (no prefix cache)
    first = request.param in ("llama3", "qwen3")
    ours = JaxpagedRollout(model, tokenizer, rollout_config=rollout_config(), max_num_seqs=4,
                           max_num_batched_tokens=64, block_size=8, compilation_cache_dir=compile_cache,
                           warmup=first, enable_prefix_caching=first)
    c = model.config
    vanilla = VanillaRollout(model, tokenizer, base_rollout.CacheConfig(64, c.num_layers, c.num_kv_heads, c.head_dim))
    return model, ours, vanilla


def test_greedy_equals_tunix_model(pair, tokenizer):
    model, ours, vanilla = pair
    rc = rollout_config(return_logprobs=True)
    a = ours.generate(PROMPTS, rc)
    assert_tunix_greedy(model, tokenizer, PROMPTS, [x.tolist() for x in a.tokens], GEN, ours.eos_id())
    assert a.text == [tokenizer.decode(t.tolist()) for t in a.tokens]
    # padding exactly as the vanilla sampler's: left, with pad_id, to the next power of two over the longest
    prompts = [[tokenizer.bos_token_id] + tokenizer.encode(p) for p in PROMPTS]
    width = 16 if max(map(len, prompts)) <= 16 else tunix_utils.next_power_of_2(max(map(len, prompts)))
    np.testing.assert_array_equal(a.left_padded_prompt_tokens, np.array(
        [tunix_utils.pad_to_length(np.array(p), target_length=width, pad_value=ours.pad_id(), left=True)
         for p in prompts]))
    # the sampled tokens' processed logprobs are the trainer's logps of the same tokens
    comp = _completions(a, ours.eos_id(), ours.pad_id())
    ref = np.asarray(vanilla.get_per_token_logps(a.left_padded_prompt_tokens, comp))
    for i, x in enumerate(a.logprobs):
        np.testing.assert_allclose(x, ref[i, :len(x)], atol=1e-5)


def _completions(out, eos: int, pad: int) -> np.ndarray:
    """Completions right-padded to GEN, each ended by EOS when shorter."""
    comp = np.full((len(out.tokens), GEN), pad, np.int32)
    for i, t in enumerate(out.tokens):
        t = list(t) + ([eos] if len(t) < GEN else [])
        comp[i, :len(t)] = t
    return comp


def test_per_token_logps_equal_vanilla(pair):
    _, ours, vanilla = pair
    out = ours.generate(PROMPTS, rollout_config())
    comp = _completions(out, ours.eos_id(), ours.pad_id())
    a = np.asarray(ours.get_per_token_logps(out.left_padded_prompt_tokens, comp))
    b = np.asarray(vanilla.get_per_token_logps(out.left_padded_prompt_tokens, comp))
    mask = np.cumsum(np.cumsum(comp == ours.eos_id(), 1), 1) <= 1  # up to and including the first EOS
    np.testing.assert_allclose(a[mask], b[mask], atol=1e-5)


def test_seeded_sampling_reproducible(pair):
    _, ours, _ = pair
    rc = rollout_config(temperature=1.0, top_k=50, top_p=0.9, seed=jax.random.PRNGKey(7))
    a, b = ours.generate(PROMPTS, rc), ours.generate(PROMPTS, rc)
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    other = ours.generate(PROMPTS, rollout_config(temperature=1.0, seed=jax.random.PRNGKey(8)))
    assert [t.tolist() for t in other.tokens] != [t.tolist() for t in a.tokens]


def test_update_params_follows_new_weights(pair, tokenizer):
    """The rollouts take another model's weights, then `model`'s back: the pair is shared by the module's later
    tests, which compare the rollouts with `model` (Tunix's vanilla sampler keeps its own copy of the
    weights, so `model` itself never changes)."""
    tok = tokenizer
    model, ours, vanilla = pair
    rc = rollout_config()
    before = [t.tolist() for t in ours.generate(PROMPTS, rc).tokens]
    compiles = ours.engine.stats()["num_compilations"]
    new = tiny_tunix_model(type(model).__name__.lower(), seed=3)
    params = nnx.state(new, nnx.Param)
    try:
        ours.update_params(params)
        vanilla.update_params(params)
        a = ours.generate(PROMPTS, rc)
        assert_tunix_greedy(new, tok, PROMPTS, [x.tolist() for x in a.tokens], GEN, ours.eos_id())
        assert [t.tolist() for t in a.tokens] != before
        assert ours.engine.stats()["num_compilations"] == compiles
        assert ours.engine.block_manager.num_free_blocks == ours.engine.num_blocks - 1
    finally:
        ours.update_params(nnx.state(model, nnx.Param))
        vanilla.update_params(nnx.state(model, nnx.Param))
    assert [t.tolist() for t in ours.generate(PROMPTS, rc).tokens] == before


def test_unsupported_model_is_a_value_error(tokenizer):
    class Gemma(nnx.Module):
        config = None
    with pytest.raises(ValueError, match="Gemma"):
        JaxpagedRollout(Gemma(), tokenizer)
    # Gemma 3 sliding layers with a RoPE scale factor: the engine scales global layers only
    m = gemma3.Gemma3(gemma3.ModelConfig(**{**GEMMA3, "num_layers": 1, "local_scale_factor": 2.0}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="local_scale_factor"):
        JaxpagedRollout(m, tokenizer)


# -- real GRPO runs: Tunix's GRPOLearner over an RLCluster rolling out through JaxpagedRollout ----------------
class RecordingRollout(JaxpagedRollout):
    """JaxpagedRollout noting, at each weight sync, the filter types Tunix passed and the engine's compilations."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.syncs = []

    def update_params(self, params, filter_types=None) -> None:
        super().update_params(params, filter_types)
        self.syncs.append((filter_types, self.engine.stats()["num_compilations"]))


def grpo_learner(model, tokenizer, compile_cache, steps: int, **rollout_kwargs):
    """(cluster, learner, dataset): GRPO with G = 2 on one CPU device (float32), the same engine shapes as `pair`
    (so the step compiles come from the persistent cache), a toy reward (distinct characters of a
    completion), Adam at a rate high enough that two steps move the greedy tokens, no KL term."""
    import optax
    from jax.sharding import AxisType
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner as grpo
    # Tunix's models shard with the mesh's axes in Auto mode (an Explicit mesh rejects their embedding gather)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1], axis_types=(AxisType.Auto,) * 2)
    engine = functools.partial(RecordingRollout, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                               compilation_cache_dir=compile_cache, **rollout_kwargs)
    config = rl.ClusterConfig(
        role_to_mesh={r: mesh for r in (rl.Role.ACTOR, rl.Role.REFERENCE, rl.Role.ROLLOUT)}, rollout_engine=engine,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.adam(3e-2), eval_every_n_steps=1000,
                                            max_steps=steps),
        rollout_config=rollout_config(temperature=1.0, seed=jax.random.PRNGKey(0)))
    cluster = rl.RLCluster(actor=model, tokenizer=tokenizer, cluster_config=config)
    learner = grpo.GRPOLearner(cluster, grpo.GRPOConfig(num_generations=2, beta=0.0),
                               reward_fns=lambda prompts, completions, **_: [float(len(set(c))) for c in completions])
    return cluster, learner, [{"prompts": np.array(PROMPTS[:2])}] * steps  # 2 prompts x G = max_num_seqs


def greedy(rollout) -> list[list[int]]:
    return [t.tolist() for t in rollout.generate(PROMPTS, rollout_config()).tokens]


def test_grpo_run_syncs_full_params(tokenizer, compile_cache):
    steps = 2
    cluster, learner, data = grpo_learner(tiny_tunix_model("llama3", seed=5), tokenizer, compile_cache, steps)
    ours = cluster.rollout
    assert isinstance(ours, RecordingRollout) and learner.should_sync_weights
    actor = cluster.actor_trainer.model
    start = jax.tree.map(np.array, nnx.state(actor, nnx.Param))
    before = greedy(ours)
    compiles = ours.engine.stats()["num_compilations"]
    learner.train(data)
    assert cluster.actor_trainer.train_steps == steps
    # one full-parameter sync per global step, none of them compiling anything
    assert ours.syncs == [((nnx.Param,), compiles)] * steps
    # every KV block back in the pool at the end of the run
    stats = ours.engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert ours.engine.block_manager.num_free_blocks == ours.engine.num_blocks - 1
    # the engine runs the trained actor's weights, bit for bit, and its greedy tokens are the actor's
    state = nnx.state(actor, nnx.Param)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(state)))
    want = to_engine_params(state, actor.config, False, np.float32)
    got = ours.engine.get_weights()
    for path, w in jax.tree_util.tree_flatten_with_path(want)[0]:
        np.testing.assert_array_equal(np.asarray(functools.reduce(lambda t, k: t[k.key], path, got)), np.asarray(w))
    after = greedy(ours)
    assert_tunix_greedy(actor, tokenizer, PROMPTS, after, GEN, ours.eos_id())
    assert after != before
    assert ours.engine.stats()["num_compilations"] == compiles


LORA_ALPHA = 8.0


def tiny_lora_model(seed: int = 7):
    """A qwix LoRA (rank 4, alpha 8) over every projection of a tiny Tunix Llama 3, B redrawn (std 0.1) so the
    adapter changes the greedy tokens from the start (qwix starts B at zero)."""
    import qwix
    base = tiny_tunix_model("llama3", seed=seed)
    provider = qwix.LoraProvider(module_path=".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)", rank=4,
                                 alpha=LORA_ALPHA)
    import jax.numpy as jnp
    T = 4  # qwix creates the LoRA parameters in one forward
    model = qwix.apply_lora_to_model(base, provider, jnp.ones((1, T), jnp.int32), jnp.arange(T)[None], None,
                                     jnp.tril(jnp.ones((1, T, T), bool)), rngs=nnx.Rngs(seed))
    lora = nnx.state(model, nnx.LoRAParam)
    key = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(lora))))
    redraw = lambda p, a: 0.1 * jax.random.normal(next(key), a.shape, a.dtype) if "lora_b" in jax.tree_util.keystr(p) \
        else a
    lora = jax.tree_util.tree_map_with_path(redraw, lora)
    nnx.update(model, lora)
    return base, model


def test_grpo_run_syncs_lora(tokenizer, compile_cache):
    base, model = tiny_lora_model()
    with pytest.raises(ValueError, match="lora_alpha"):  # qwix keeps alpha in its provider, not in the model
        JaxpagedRollout(model, tokenizer)
    cluster, learner, data = grpo_learner(model, tokenizer, compile_cache, 1, lora_alpha=LORA_ALPHA)
    ours = cluster.rollout
    actor = cluster.actor_trainer.model
    # built merged: the engine's greedy tokens are the LoRA model's, not its base's
    before = greedy(ours)
    assert_tunix_greedy(actor, tokenizer, PROMPTS, before, GEN, ours.eos_id())
    assert any(b[:len(x)].tolist() != x for b, x in zip(tunix_argmax(base, tokenizer, PROMPTS, before), before))
    lora0 = jax.tree.map(np.array, nnx.state(actor, nnx.LoRAParam))
    frozen0 = jax.tree.map(np.array, nnx.state(actor, nnx.Not(nnx.LoRAParam)))
    wq0 = np.array(ours.engine.get_weights()["layers"]["wq"])
    compiles = ours.engine.stats()["num_compilations"]
    learner.train(data)
    # Tunix trained the adapter only and synced it alone; the engine merged it, compiling nothing
    assert ours.syncs == [((nnx.LoRAParam,), compiles)]
    lora1 = nnx.state(actor, nnx.LoRAParam)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lora0), jax.tree.leaves(lora1)))
    for a, b in zip(jax.tree.leaves(frozen0), jax.tree.leaves(nnx.state(actor, nnx.Not(nnx.LoRAParam)))):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(np.asarray(ours.engine.get_weights()["layers"]["wq"]), wq0)
    assert ours.engine.block_manager.num_free_blocks == ours.engine.num_blocks - 1
    assert_tunix_greedy(actor, tokenizer, PROMPTS, greedy(ours), GEN, ours.eos_id())
    # a LoRA on some layers only: the other layers' weights come from the base, unmerged
    lora = nnx.state(actor, nnx.LoRAParam).to_pure_dict()
    del lora["layers"][next(k for k in lora["layers"] if str(k) == "1")]
    frozen = nnx.state(actor, nnx.Not(nnx.LoRAParam))
    part = to_engine_params(lora, actor.config, False, np.float32, LORA_ALPHA, frozen)["layers"]
    plain = to_engine_params(frozen, actor.config, False, np.float32)["layers"]
    merged = ours.engine.get_weights()["layers"]
    assert set(part) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    for leaf, w in part.items():
        np.testing.assert_array_equal(np.asarray(w[0]), np.asarray(merged[leaf][0]))
        np.testing.assert_array_equal(np.asarray(w[1]), np.asarray(plain[leaf][1]))
        assert not np.array_equal(np.asarray(w[0]), np.asarray(plain[leaf][0]))


# -- sampled distributions: RolloutConfig read as the vanilla sampler reads it ---------------------------------
@pytest.mark.parametrize("pair", ["llama3"], indirect=True)
def test_sampled_distribution_is_vanillas(pair, tokenizer):
    """At temperature 1, with top-p and with top-k: the first token JaxpagedRollout samples (N requests, one seed
    each) and the tokens of Tunix's own `sample_top_p` over the model's logits follow the exact distribution
    (total variation under the bound of N draws); with top_p None both are the argmax, at temperature 1."""
    from tunix.generate import sampler as tunix_sampler
    sample_top_p = jax.jit(tunix_sampler.sample_top_p, static_argnums=(2, 3, 4))  # one compile, not one per op
    model, ours, _ = pair
    # greedy at temperature 1 when top_p is None, and the model's argmax: the engine holds `model`'s weights, so
    # its logits below are the rollout's
    rc = rollout_config(temperature=1.0, top_p=None, top_k=50, seed=jax.random.PRNGKey(3))
    a = ours.generate(PROMPTS, rc)
    assert_tunix_greedy(model, tokenizer, PROMPTS, [x.tolist() for x in a.tokens], GEN, ours.eos_id())
    n = 1200
    ids = [[tokenizer.bos_token_id] + tokenizer.encode(p) for p in PROMPTS]
    seqs = np.zeros((len(ids), 32), np.int32)
    for i, a in enumerate(ids):
        seqs[i, :len(a)] = a
    last = np.asarray(_logits(model, seqs))[np.arange(len(ids)), [len(a) - 1 for a in ids]]  # [prompts, V]
    flat = int(np.argmax(np.exp(last - last.max(-1, keepdims=True)).sum(-1)))  # its next token least certain
    logits = last[flat]
    for top_p, top_k in ((0.6, None), (1.0, 3)):
        p = filtered_softmax(logits, 1.0, top_p, top_k)
        bound = tv_bound(p, n)
        full = filtered_softmax(logits, 1.0, 1.0, None)
        # the check has power: greedy decoding, or sampling unfiltered, would be further than the bound
        assert 1 - p.max() > 2 * bound and np.abs(full - p).sum() / 2 > 2 * bound, (p.max(), bound)
        theirs = sample_top_p(jnp.broadcast_to(jnp.asarray(logits), (n, 1, len(logits))),
                              jax.random.PRNGKey(top_k or 0), 1.0, top_p, top_k)[0]
        assert tv(np.asarray(theirs), p) < bound, "the reference is not the vanilla sampler's distribution"
        rc = rollout_config(temperature=1.0, top_p=top_p, top_k=top_k, max_tokens_to_generate=1,
                            seed=jax.random.PRNGKey(11))
        out = ours.generate([PROMPTS[flat]] * n, rc)
        got = np.array([t[0] if len(t) else ours.eos_id() for t in out.tokens])
        assert tv(got, p) < bound, (top_p, top_k, tv(got, p), bound)
        assert set(got.tolist()) <= set(np.flatnonzero(p).tolist())  # nothing outside the kept tokens
