"""Research hooks against transformers: hidden states, steering (forward hooks as the oracle), weight updates."""
import numpy as np
import pytest
from oracle import hf_model

from jaxpaged import LLM, SamplingParams
from jaxpaged.testing.tiny_models import make_tiny_model, one_prompt_decoder_inputs

LAYERS = [0, 2, 3]   # embeddings, output of layer 1, final norm (3 layers)
STEER = [0, 2]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("research")
    return [make_tiny_model(str(root / f"m{seed}"), "llama", num_layers=3, seed=seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def llm(paths, engine_kwargs):
    return LLM(model=paths[0], **{**engine_kwargs, "max_num_batched_tokens": 16},
               hidden_state_layers=LAYERS, steering_layers=STEER)


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


def _hf_run(path, prompt, max_new_tokens, steering=None):
    """HF greedy tokens, then hidden_states[i] [len, D] of prompt + generated (EOS neither stops nor is
    masked), with forward hooks adding `steering` {layer index: vector} as the engine does."""
    import torch
    model = hf_model(path)
    handles = []
    for i, vec in (steering or {}).items():
        mod = model.model.embed_tokens if i == 0 else model.model.layers[i - 1]
        v = torch.tensor(np.asarray(vec, np.float32))
        # prepended: transformers records output_hidden_states by hooks too, and sees the steered output
        handles.append(mod.register_forward_hook(lambda m, a, out, v=v: out + v, prepend=True))
    try:
        ids, out = list(prompt), []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                out.append(tok)
                ids.append(tok)
            res = model(torch.tensor([ids[:-1]]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return out, np.stack([res.hidden_states[i][0].numpy() for i in LAYERS], axis=1)  # [len, nL, D]


def _close(got, want):
    """float32 against HF: rtol 1e-4, atol 1e-4 of each layer's largest value (the residual grows)."""
    assert got.shape == want.shape
    for k in range(want.shape[1]):
        np.testing.assert_allclose(got[:, k], want[:, k], rtol=1e-4, atol=1e-4 * np.abs(want[:, k]).max())


def test_hidden_states_match_hf(llm, paths):
    prompts = [_prompt(1, 40), _prompt(2, 9), _prompt(3, 21)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_hidden_states=True,
                             return_prompt_hidden_states=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),  # asks nothing
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, return_hidden_states=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o, sp in zip(prompts, outs, params):
        toks, want = _hf_run(paths[0], p, sp.max_tokens)
        c = o.outputs[0]
        assert c.token_ids == toks
        if not sp.return_hidden_states:
            assert c.hidden_states is None and o.prompt_hidden_states is None
            continue
        assert c.hidden_states.shape == (sp.max_tokens, len(LAYERS), 64) and c.hidden_states.dtype == np.float32
        # row j: the position whose logits produced generated token j (the prompt's last, then each new one)
        _close(c.hidden_states, want[len(p) - 1:])
        if sp.return_prompt_hidden_states:  # 40 tokens through a budget of 16: three prefill chunks
            _close(o.prompt_hidden_states, want[:len(p)])
        else:
            assert o.prompt_hidden_states is None


def test_steering_matches_hf_hooks(llm, paths):
    rng = np.random.default_rng(7)
    steering = {0: rng.normal(0, 0.5, 64).astype(np.float32), 2: rng.normal(0, 2.0, 64).astype(np.float32)}
    p = _prompt(4, 19)
    toks, want = _hf_run(paths[0], p, 8, steering)
    plain, _ = _hf_run(paths[0], p, 8)
    assert toks != plain  # the vectors change the greedy continuation
    o, = llm.generate([{"prompt_token_ids": p}], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, steering_vectors=steering, return_hidden_states=True,
        return_prompt_hidden_states=True), use_tqdm=False)
    assert o.outputs[0].token_ids == toks
    _close(o.outputs[0].hidden_states, want[len(p) - 1:])
    _close(o.prompt_hidden_states, want[:len(p)])


def test_steered_and_plain_share_no_blocks(llm, paths):
    """Same prompt (4 full blocks), one request steered and one not, prefix caching on: the unsteered one
    equals a plain run and the steered one HF's hooked run, whichever ran first."""
    p = _prompt(5, 70)
    steering = {0: np.random.default_rng(8).normal(0, 1.0, 64).astype(np.float32)}
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    plain_toks, _ = _hf_run(paths[0], p, 6)
    steered_toks, _ = _hf_run(paths[0], p, 6, steering)
    assert plain_toks != steered_toks
    for _ in range(2):  # the second time, both prompts' blocks are in the prefix cache
        outs = llm.generate([{"prompt_token_ids": p}] * 2, [SamplingParams(**greedy, steering_vectors=steering),
                                                            SamplingParams(**greedy)], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == steered_toks
        assert outs[1].outputs[0].token_ids == plain_toks
    assert llm.stats()["prefix_cache_hit_rate"] > 0


def test_bad_input_names_the_field(llm, paths, engine_kwargs):
    with pytest.raises(ValueError, match="hidden_state_layers"):
        LLM(model=paths[0], **engine_kwargs, hidden_state_layers=[0, 4])
    with pytest.raises(ValueError, match="steering_layers"):
        LLM(model=paths[0], **engine_kwargs, steering_layers=[3])  # the final norm cannot be steered
    p = {"prompt_token_ids": _prompt(6, 5)}
    for bad, field in [(dict(steering_vectors={1: np.ones(64)}), "not compiled"),
                       (dict(steering_vectors={0: np.ones(63)}), "hidden size is 64"),
                       (dict(steering_vectors={0: [np.nan] * 64}), "steering_vectors")]:
        with pytest.raises(ValueError, match=field):
            llm.generate(p, SamplingParams(**bad), use_tqdm=False)
    from jaxpaged.step.research import check_params
    with pytest.raises(ValueError, match="return_prompt_hidden_states.*hidden_state_layers"):
        check_params(SamplingParams(return_prompt_hidden_states=True), (), STEER, 64)  # capture not compiled
    o, = llm.generate(p, SamplingParams(max_tokens=3), use_tqdm=False)  # still serving
    assert len(o.outputs[0].token_ids) == 3


def test_hooks_inside_a_layer_pattern(tmp_path):
    """Gemma 3 (layers scanned in groups of 3, plus a tail layer): capture and steering at every kind of
    index — embeddings, inside a group (unrolled), the tail, the final norm — against HF hooks."""
    import jax.numpy as jnp
    import torch

    from jaxpaged import ModelConfig
    from jaxpaged.models.llama import decoder
    from jaxpaged.step.attention import make_attention
    path = make_tiny_model(str(tmp_path / "gemma3"), "gemma3", seed=3)
    cfg = ModelConfig.from_dir(path)
    assert cfg.layer_period == 3 and cfg.num_layers == 4
    p = _prompt(9, 13)
    rng = np.random.default_rng(10)
    steering = {1: rng.normal(0, 1, 64).astype(np.float32), 3: rng.normal(0, 1, 64).astype(np.float32)}
    capture = (0, 1, 2, 3, 4)
    params, pool, batch = one_prompt_decoder_inputs(path, cfg, p)
    vec = jnp.broadcast_to(jnp.stack([steering[1], steering[3]]), (len(p), 2, 64))  # [T, nS, D]
    *_, states = decoder(params, cfg, pool, pool, batch, make_attention("reference", False), capture=capture,
                         steer=(1, 3), steering=vec)
    model = hf_model(path)
    handles = [model.model.layers[i - 1].register_forward_hook(
        lambda m, a, out, v=torch.tensor(v): out + v, prepend=True) for i, v in steering.items()]
    try:
        with torch.no_grad():
            res = model(torch.tensor([p]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    want = np.stack([res.hidden_states[i][0].numpy() for i in capture], axis=1)
    _close(np.asarray(states), want)


def test_update_weights(llm, paths, engine_kwargs):
    """Swap in another random model's weights (HF names, then the pytree back, then a partial update):
    outputs equal a fresh LLM on those weights, with no recompilation."""
    from jaxpaged.checkpoints.weights import read_safetensors, safetensors_files
    prompts = [{"prompt_token_ids": _prompt(11, 30)}, {"prompt_token_ids": _prompt(12, 7)}]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    before, compiled = run(), llm.stats()["num_compilations"]
    old = llm.get_weights()
    new_pairs = [(n, np.array(a)) for f in safetensors_files(paths[1]) for n, a in read_safetensors(f)]
    llm.update_weights(iter(new_pairs))
    fresh = LLM(model=paths[1], **{**engine_kwargs, "max_num_batched_tokens": 16})
    want = [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy, use_tqdm=False)]
    assert want != before and run() == want
    llm.update_weights(old)  # the old device arrays, adopted as they are
    assert run() == before
    assert all(a is b for a, b in zip(jax_leaves(llm.get_weights()), jax_leaves(old)))
    # a partial update: one layer's MLP and the final norm of model 1 -> equals that mix, built by hand
    part = [(n, a) for n, a in new_pairs if n.startswith("model.layers.1.mlp.") or n == "model.norm.weight"]
    llm.update_weights(part)
    mixed = fresh.get_weights()
    for key in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(llm.get_weights()["layers"][key]),
                                      np.concatenate([np.asarray(old["layers"][key])[:1],
                                                      np.asarray(mixed["layers"][key])[1:2],
                                                      np.asarray(old["layers"][key])[2:]]))
    np.testing.assert_array_equal(np.asarray(llm.get_weights()["final_norm"]), np.asarray(mixed["final_norm"]))
    assert llm.stats()["num_compilations"] == compiled
    # bad input names the tensor, changes nothing, and the engine keeps serving
    cases = [([("model.layers.9.mlp.up_proj.weight", new_pairs[0][1])], "model.layers.9.mlp.up_proj.weight"),
             ([("model.norm.weight", np.ones(63, np.float32))], "model.norm.weight"),
             ([("model.norm.weight", np.ones(64, np.float64))], "dtype"),
             ({"layers": {"wq": np.ones((3, 64, 5), np.float32)}}, "layers.wq"),
             ({"no_such": np.ones(3, np.float32)}, "no_such")]
    for bad, name in cases:
        with pytest.raises(ValueError, match=name):
            llm.update_weights(bad)
    llm.update_weights(old)
    assert run() == before and llm.stats()["num_compilations"] == compiled


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_hidden_states_with_async_scheduling(llm, paths, engine_kwargs):
    """The async path (the default on accelerators) reads states back one step late: same arrays."""
    eng = LLM(model=paths[0], **{**engine_kwargs, "max_num_batched_tokens": 16}, async_scheduling=True,
              hidden_state_layers=LAYERS, steering_layers=STEER)
    steer = {2: np.full(64, 3.0, np.float32)}
    prompts = [{"prompt_token_ids": _prompt(13, 23)}, {"prompt_token_ids": _prompt(14, 5)}]
    params = [SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, return_hidden_states=True,
                             return_prompt_hidden_states=True, steering_vectors=steer),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, return_hidden_states=True)]
    got, want = (e.generate(prompts, params, use_tqdm=False) for e in (eng, llm))
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        np.testing.assert_allclose(g.outputs[0].hidden_states, w.outputs[0].hidden_states, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(got[0].prompt_hidden_states, want[0].prompt_hidden_states, rtol=1e-6, atol=1e-5)
    # running requests: update_weights refuses, and nothing changes
    e = eng.engine
    e.add_request("r", prompts[1], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="unfinished"):
        eng.update_weights(eng.get_weights())
    e.abort_request("r")


def _recipe(section: str) -> str:
    import os
    import re
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "research.md")) as f:
        part = f.read().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", part, re.S))


@pytest.mark.slow  # an engine each (~15 s; 40 s on a loaded 2-core machine)
@pytest.mark.parametrize("section", ["Hidden states", "Steering", "Weight updates and an RL rollout loop"])
def test_docs_recipes(section, paths, engine_kwargs, monkeypatch):
    """docs/research.md's recipes, as written, on the tiny model (engine sizes kept small)."""
    import functools

    import jaxpaged
    warm = section.startswith("Weight updates")  # every shape compiled first: the updates must recompile none
    monkeypatch.setattr(jaxpaged, "LLM", functools.partial(LLM, **{**engine_kwargs, "warmup": warm}))
    ns = {"model": paths[0]}
    exec(compile(_recipe(section), f"docs/research.md: {section}", "exec"), ns)
    if section == "Hidden states":
        assert ns["probe_accuracy"] >= 0.9
    elif section == "Steering":
        assert ns["steered"].outputs[0].token_ids != ns["plain"].outputs[0].token_ids and ns["shift"] > 0
    else:
        assert ns["rewards"][-1] > ns["rewards"][0] + 0.1
        stats = ns["llm"].stats()
        assert stats["num_compilations"] == stats["num_buckets"]  # the updates recompiled nothing
