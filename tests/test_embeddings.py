"""Embeddings (--runner pooling): pooled final-norm hidden states against transformers' (last-token, mean,
first-token; normalized or not) on tiny random models of two families, through chunked prefill and a
prefix-cache hit; LLM.embed / LLM.pair_score; the HTTP routes (/v1/embeddings through the `openai` client,
/pooling, /score, /rerank) and their refusals. One engine per family, in-process apps over the llama one."""
import base64

import numpy as np
import openai
import pytest
from oracle import hf_model
from starlette.testclient import TestClient
from test_server import make_tokenizer

from jaxpaged import LLM, PoolingParams, SamplingParams
from jaxpaged.core.pooling import Pooling
from jaxpaged.testing.tiny_models import make_tiny_model

BUDGET = 8  # max_num_batched_tokens: prompts past it are prefilled in chunks (one token bucket: one compile)
LONG = 40  # tokens: five chunks


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    out = {f: make_tiny_model(str(root / f), f, num_layers=2, seed=i) for i, f in enumerate(("llama", "qwen3"))}
    make_tokenizer(out["llama"])
    return out


@pytest.fixture(scope="module")
def llama(paths, engine_kwargs):
    return LLM(model=paths["llama"], **{**engine_kwargs, "max_num_batched_tokens": BUDGET}, runner="pooling")


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(5, 256, n)]


def _hf_pooled(path, prompt, kind, normalize):
    """transformers' final hidden state (after the final norm) pooled as `kind`."""
    import torch
    with torch.no_grad():
        h = hf_model(path)(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].numpy()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    return v / np.linalg.norm(v) if normalize else v


def _pooled(llm, prompts, kind, normalize):
    """The engine's RequestOutputs of pooling requests of `kind` (SamplingParams.pooling, as LLM.embed sets it)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=Pooling(kind, normalize))
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize", [False, True])
def test_pooled_states_equal_transformers(llama, paths, kind, normalize):
    prompts = [_prompt(1, LONG), _prompt(2, 5), _prompt(3, 23)]  # chunked, short, and across a chunk boundary
    outs = _pooled(llama, prompts, kind, normalize)
    for p, o in zip(prompts, outs):
        np.testing.assert_allclose(o.pooled, _hf_pooled(paths["llama"], p, kind, normalize), atol=1e-4, rtol=0)
        assert len(o.outputs[0].token_ids) == 1 and o.finished  # finished after its prefill


def test_prefix_cache_hit_last_and_bypass_mean(llama, paths):
    """LAST pooling is served from the prefix cache (only the last position is needed); MEAN computes the
    whole prompt again; both still equal transformers'."""
    p = _prompt(4, LONG)
    _pooled(llama, [p], "LAST", True)
    hit = _pooled(llama, [p], "LAST", True)[0]
    assert hit.num_cached_tokens >= 32
    np.testing.assert_allclose(hit.pooled, _hf_pooled(paths["llama"], p, "LAST", True), atol=1e-4, rtol=0)
    mean = _pooled(llama, [p], "MEAN", False)[0]
    assert mean.num_cached_tokens == 0
    np.testing.assert_allclose(mean.pooled, _hf_pooled(paths["llama"], p, "MEAN", False), atol=1e-4, rtol=0)


def test_embed_and_pair_score(llama, paths):
    prompts = [_prompt(5, 12), _prompt(6, 30)]
    outs = llama.embed(prompts, use_tqdm=False)  # the engine's pooler config: LAST, normalized
    for p, o in zip(prompts, outs):
        np.testing.assert_allclose(o.outputs.embedding, _hf_pooled(paths["llama"], p, "LAST", True), atol=1e-4)
    raw = llama.embed(prompts[0], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(raw, _hf_pooled(paths["llama"], prompts[0], "LAST", False), atol=1e-4)
    scores = [s.outputs.score for s in llama.pair_score(prompts[0], prompts, use_tqdm=False)]
    e = [np.asarray(o.outputs.embedding) for o in outs]
    np.testing.assert_allclose(scores, [1.0, float(e[0] @ e[1])], atol=1e-5)
    with pytest.raises(ValueError, match="dimensions"):
        llama.embed(prompts, PoolingParams(dimensions=8))


def test_pooling_needs_the_runner(paths, engine_kwargs):
    generating = LLM(model=paths["llama"], **engine_kwargs)  # refused before any step compiles
    with pytest.raises(ValueError, match="runner='pooling'"):
        generating.embed([[5, 6]])
    with pytest.raises(ValueError, match="runner='pooling'"):  # the engine's own check (admission)
        generating.generate([[5, 6]], SamplingParams(max_tokens=1, pooling=Pooling("LAST", True)))
    for bad in (dict(max_tokens=2), dict(max_tokens=1, n=2)):  # a pooling request finishes after its prompt
        with pytest.raises(ValueError, match="pooling"):
            SamplingParams(**bad, pooling=Pooling("LAST", True))
    with pytest.raises(ValueError, match="convert"):
        LLM(model=paths["llama"], **engine_kwargs, runner="generate", convert="embed")
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(model=paths["llama"], **engine_kwargs, runner="pooling", pooler_config={"pooling_type": "ALL"})


def test_second_family(paths, engine_kwargs):
    """Qwen3 (per-head q/k norms), with its pooler config from the JSON flag: MEAN, not normalized."""
    llm = LLM(model=paths["qwen3"], **{**engine_kwargs, "max_num_batched_tokens": BUDGET}, convert="embed",
              pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    prompts = [_prompt(7, LONG), _prompt(8, 9)]
    for p, o in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        np.testing.assert_allclose(o.outputs.embedding, _hf_pooled(paths["qwen3"], p, "MEAN", False), atol=1e-4)
    last = _pooled(llm, prompts, "LAST", True)
    for p, o in zip(prompts, last):
        np.testing.assert_allclose(o.pooled, _hf_pooled(paths["qwen3"], p, "LAST", True), atol=1e-4, rtol=0)


# -- HTTP, in-process, over the llama engine (after the tests above: the app's loop steps it from now on) ------
@pytest.fixture(scope="module")
def client(llama):
    from jaxpaged.async_engine import AsyncEngine
    from serve.app import create_app
    async_engine = AsyncEngine(llama.engine)
    app = create_app(async_engine, served_model_name="tiny", shutdown_engine=False, max_embedding_inputs=4)
    with TestClient(app) as c:
        yield c
    async_engine.shutdown()


WORDS = ["the quick brown fox", "hello world", "the lazy dog jumps", "a b c d"]


def _embedding(client, text):
    r = client.post("/v1/embeddings", json={"input": text, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["data"][0]["embedding"])


def test_openai_client_embeddings(client, llama):
    oa = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client)
    got = oa.embeddings.create(model="tiny", input=WORDS[:2])  # the client asks base64 and decodes it
    ids = [llama.tokenizer.encode(w) for w in WORDS[:2]]
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens == sum(len(i) for i in ids)
    for d, w in zip(got.data, WORDS[:2]):
        np.testing.assert_allclose(d.embedding, _embedding(client, w), atol=1e-6)
    floats = oa.embeddings.create(model="tiny", input=ids, encoding_format="float").data
    np.testing.assert_allclose(floats[1].embedding, got.data[1].embedding, atol=1e-6)


def test_pooling_route_base64(client):
    r = client.post("/pooling", json={"input": [[5, 6, 7]], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    vec = np.frombuffer(base64.b64decode(item["data"]), "<f4")
    assert item["object"] == "pooling"
    np.testing.assert_allclose(vec, _embedding(client, [5, 6, 7]), atol=1e-6)


def test_score_and_rerank_order_by_the_scores(client):
    e = [_embedding(client, w) for w in WORDS]
    cos = [float(e[0] @ v / np.linalg.norm(e[0]) / np.linalg.norm(v)) for v in e[1:]]
    r = client.post("/score", json={"text_1": WORDS[0], "text_2": WORDS[1:]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], cos, atol=1e-5)
    for path in ("/rerank", "/v1/rerank"):
        r = client.post(path, json={"query": WORDS[0], "documents": WORDS[1:], "top_n": 2})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == sorted(range(3), key=lambda i: -cos[i])[:2]
        assert [x["relevance_score"] for x in res] == sorted([x["relevance_score"] for x in res], reverse=True)
        assert res[0]["document"]["text"] == WORDS[1 + res[0]["index"]]
    pairwise = client.post("/v1/score", json={"text_1": WORDS[:2], "text_2": WORDS[2:]}).json()["data"]
    assert len(pairwise) == 2


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/embeddings", {"input": ["a"] * 5}, "input", "too_many_inputs"),  # --max-embedding-inputs 4
    ("/v1/embeddings", {"input": []}, "input", None),
    ("/v1/embeddings", {"input": [["a"]]}, "input", None),
    ("/v1/embeddings", {"input": {"text": "a"}}, "input", None),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input", None),
    ("/v1/embeddings", {"input": [999]}, "input", None),  # out of vocabulary
    ("/v1/embeddings", {"input": "   "}, "input", "empty_prompt"),
    ("/v1/embeddings", {"input": [5] * 256}, "input", "context_length_exceeded"),
    ("/v1/embeddings", {"input": "a", "dimensions": 8}, "dimensions", "unsupported_dimensions"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format", None),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1", "invalid_combination"),
    ("/score", {"text_1": "a", "text_2": ["b"] * 4}, "text_1", "too_many_inputs"),
    ("/rerank", {"query": "a", "documents": []}, "documents", None),
])
def test_bad_inputs_are_refused_naming_the_field(client, path, body, param, code):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert _embedding(client, "hello").shape == (64,)  # nothing lost: the next request is served
