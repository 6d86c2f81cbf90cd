"""Routed experts for routing replay (SamplingParams.return_routed_experts, issue 28): each token's top-k
expert ids per layer equal those of HF transformers' MoE model (top k of the softmax of its router
logits) on the same tiny random float32 weights, through chunked prefill, prefix-cache hits, n > 1,
preemption (sync and async scheduling), a pause that keeps requests across a weight update, and a batch
with requests that do not ask; a dense model refuses by name (400 on the server). Tensor and expert
parallelism: tests/test_expert_parallel.py."""
import numpy as np
import pytest
from oracle import hf_greedy, hf_routed_experts
from starlette.testclient import TestClient

from jaxpaged import LLM, SamplingParams
from jaxpaged.step.routed_experts import RoutedExperts
from jaxpaged.testing.tiny_models import make_tiny_model, one_prompt_decoder_inputs

BS = 4
ROUTES = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, return_routed_experts=True)
PLAIN = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompts(seed, lens):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 256, size=n)] for n in lens]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    return {f: make_tiny_model(str(root / f), f, seed=20 + i) for i, f in enumerate(("mixtral", "qwen3_moe", "olmoe"))}


def _engine(path, engine_kwargs, **over):
    return LLM(model=path, **{**engine_kwargs, "block_size": BS, "max_num_seqs": 4, "max_num_batched_tokens": 16,
                              "max_model_len": 128, **over})


def _check(path, out):
    """Every sample's prompt + generated routes (all but the last token's) equal HF's."""
    prompt = list(out.prompt_token_ids)
    assert out.prompt_routed_experts.dtype == np.int32
    for c in out.outputs:
        want = hf_routed_experts(path, prompt + list(c.token_ids[:-1]))  # [P + G - 1, L, k]
        assert c.routed_experts.shape == (len(c.token_ids) - 1,) + want.shape[1:]
        np.testing.assert_array_equal(out.prompt_routed_experts, want[:len(prompt)])
        np.testing.assert_array_equal(c.routed_experts, want[len(prompt):])


@pytest.mark.parametrize("family", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                    pytest.param("olmoe", marks=pytest.mark.slow)])
def test_routes_equal_hf(moe_models, engine_kwargs, family):
    """Chunked prompts (16-token budget), n = 2, beside requests that do not ask; then the same prompts
    again: those that do not ask hit the prefix cache, those that ask compute their prompts."""
    path = moe_models[family]
    llm = _engine(path, engine_kwargs)
    prompts = _prompts(1, (5, 23, 41))
    launched = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda *a, **k: launched.append(launch(*a, **k)) or launched[-1]
    for again in (False, True):
        launched.clear()
        reqs = [{"prompt_token_ids": p} for p in prompts] * 2
        params = [ROUTES, SamplingParams(**{**ROUTES.__dict__, "n": 2}), ROUTES] + [PLAIN] * 3
        outs = llm.generate(reqs, params, use_tqdm=False)
        for o in outs[:3]:
            _check(path, o)
            assert o.num_cached_tokens == 0
        for o in outs[3:]:
            assert o.prompt_routed_experts is None and o.outputs[0].routed_experts is None
        if again:
            assert sum(o.num_cached_tokens for o in outs[3:]) >= 40
        (routes,) = [f for f in llm.engine.runner.features if isinstance(f, RoutedExperts)]
        asked = {id(r) for r in routes.requests}
        plans = [plan for s in launched for f, plan, _ in s.reads if f is routes]
        assert all(id(w[0]) in asked for plan in plans for w in plan)  # read back only for them
    # no step variant for routes: every compilation is one of the start-up buckets
    assert llm.stats()["num_compilations"] == len(llm.engine.runner.variants())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_routes_through_preemption(moe_models, engine_kwargs, async_scheduling):
    """A pool too small for all requests: the preempted ones recompute, their routes replace the old
    ones (one entry per token)."""
    path = moe_models["mixtral"]
    llm = _engine(path, engine_kwargs, num_kv_blocks=16, async_scheduling=async_scheduling)
    prompts = _prompts(2, (21, 30, 9, 26))
    params = SamplingParams(**{**ROUTES.__dict__, "max_tokens": 16})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for o in outs:
        _check(path, o)


def test_routes_replaced_after_pause_keep_and_update(moe_models, engine_kwargs, tmp_path):
    """pause_generation("keep"), update_weights to another model, resume: the kept request's KV is
    recomputed, so every one of its routes is the new model's (none left from the old weights)."""
    from jaxpaged.checkpoints.weights import read_safetensors, safetensors_files
    path, other = moe_models["mixtral"], make_tiny_model(str(tmp_path / "other"), "mixtral", seed=40)
    llm = _engine(path, engine_kwargs)
    eng = llm.engine
    p = _prompts(6, (18,))[0]
    rid = eng.add_request(None, {"prompt_token_ids": p}, SamplingParams(**{**ROUTES.__dict__, "max_tokens": 10}))
    for _ in range(4):  # the prompt (two chunks) and two tokens under the old weights
        eng.step()
    llm.pause_generation("keep")
    llm.update_weights(iter([(n, np.array(a)) for f in safetensors_files(other) for n, a in read_safetensors(f)]))
    llm.resume_generation()
    done = None
    while eng.has_unfinished_requests():
        done = next((o for o in eng.step() if o.request_id == rid and o.finished), done)
    _check(other, done)


def test_dense_model_refuses_by_name(tiny_models, engine_kwargs):
    llm = LLM(model=tiny_models["llama"], **engine_kwargs)
    with pytest.raises(ValueError, match="return_routed_experts"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(return_routed_experts=True), use_tqdm=False)
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts=1)


def _app(engine):
    from jaxpaged.async_engine import AsyncEngine
    from serve.app import create_app
    async_engine = AsyncEngine(engine)
    return async_engine, create_app(async_engine, served_model_name="tiny", shutdown_engine=False)


def test_server(tiny_models, engine_kwargs, tmp_path):
    """Completions and chat return prompt_routed_experts and choices[].routed_experts as vLLM names them;
    streams, several prompts and dense models answer 400 naming return_routed_experts."""
    from test_server import make_tokenizer
    path = make_tiny_model(str(tmp_path / "mixtral"), "mixtral", seed=20)  # moe_models' weights, a tokenizer
    make_tokenizer(path)
    for model, ok in ((path, True), (tiny_models["llama"], False)):
        async_engine, app = _app(_engine(model, engine_kwargs, warmup=ok).engine)
        try:
            with TestClient(app) as client:
                p = _prompts(3, (11,))[0]
                body = {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                        "return_routed_experts": True}
                r = client.post("/v1/completions", json=body)
                if not ok:
                    assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
                    continue
                got = r.json()
                ids = got["choices"][0]["routed_experts"]
                want = hf_routed_experts(path, p + hf_greedy(path, p, 4))  # greedy: HF's tokens are the engine's
                assert np.array_equal(got["prompt_routed_experts"], want[:len(p)])
                assert np.array_equal(ids, want[len(p):])
                for extra in ({"stream": True}, {"prompt": [p, p]}):
                    r = client.post("/v1/completions", json={**body, **extra})
                    assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_experts"
                chat = {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 6,
                        "ignore_eos": True, "return_routed_experts": True}
                got = client.post("/v1/chat/completions", json=chat).json()
                prompt_ids, gen = np.array(got["prompt_routed_experts"]), np.array(got["choices"][0]["routed_experts"])
                assert prompt_ids.shape == (got["usage"]["prompt_tokens"], 2, 2) and gen.shape == (5, 2, 2)
                assert 0 <= min(prompt_ids.min(), gen.min()) and max(prompt_ids.max(), gen.max()) < 4
                assert client.post("/v1/chat/completions", json={**chat, "return_routed_experts": False}
                                   ).json()["prompt_routed_experts"] is None
        finally:
            async_engine.shutdown()


def test_decoder_routes_in_layer_order_around_hooks(tmp_path):
    """The pure decoder: a capture hook splits the layer scan in two; the ids still come in layer order."""
    from jaxpaged import ModelConfig
    from jaxpaged.models.llama import decoder
    from jaxpaged.step.attention import make_attention
    path = make_tiny_model(str(tmp_path / "mixtral3"), "mixtral", num_layers=3, seed=5)
    cfg = ModelConfig.from_dir(path)
    p = _prompts(4, (13,))[0]
    params, pool, batch = one_prompt_decoder_inputs(path, cfg, p)
    *_, states, ids = decoder(params, cfg, pool, pool, batch, make_attention("reference", False), capture=(2,),
                              routes=True)
    assert states.shape == (len(p), 1, cfg.hidden_size)
    np.testing.assert_array_equal(np.asarray(ids), hf_routed_experts(path, p))
