"""The server with LoRA: two adapters served by name (PEFT's greedy tokens), /v1/models lists them with
their parent, unknown names are 404s, adapters loaded and unloaded at run time."""
import json

import httpx
import pytest
from lora_adapters import make_adapter, peft_greedy
from test_server import Server, make_tokenizer

from jaxpaged.testing.tiny_models import make_tiny_model

PROMPT = [5, 17, 33, 9, 100, 42, 7, 61]


@pytest.fixture(scope="module")
def setup(compile_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_model(str(root / "base"), "llama", seed=3)
    make_tokenizer(base)
    adapters = {n: make_adapter(str(root / n), base, r=r, alpha=2.0 * r, seed=60 + i)
                for i, (n, r) in enumerate((("a", 4), ("b", 8), ("c", 16)))}
    srv = Server(base, compile_cache, str(root / "server.log"),
                 extra=("--enable-lora", "--lora-modules", f"a={adapters['a']}",  # b in vLLM's JSON form
                        json.dumps({"name": "b", "path": adapters["b"], "base_model_name": "tiny"}),
                        "--max-loras", "2", "--enable-runtime-lora-updating"))
    yield srv, base, adapters
    srv.stop()


def _tokens(srv, model):
    body = dict(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, ignore_eos=True)
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    return r


def test_adapters_by_name(setup):
    srv, base, adapters = setup
    models = httpx.get(srv.url + "/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a", "tiny"), ("b", "tiny")]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(base)
    for model, adapter in (("a", adapters["a"]), ("b", adapters["b"]), ("tiny", None)):
        r = _tokens(srv, model)
        assert r.status_code == 200, r.text
        want = tok.decode(peft_greedy(base, adapter, PROMPT, 5), skip_special_tokens=True)
        assert r.json()["choices"][0]["text"].strip() == want.strip()
    r = _tokens(srv, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_and_unload_at_run_time(setup, tmp_path):
    srv, base, adapters = setup
    load = lambda body: httpx.post(srv.url + "/v1/load_lora_adapter", json=body, timeout=60)  # noqa: E731
    ok = load(dict(lora_name="c", lora_path=adapters["c"]))
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'c' added successfully.", ok.text
    again = load(dict(lora_name="c", lora_path=adapters["c"]))
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    assert "c" in [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
    from transformers import AutoTokenizer
    r = _tokens(srv, "c")
    assert r.json()["choices"][0]["text"].strip() == AutoTokenizer.from_pretrained(base).decode(
        peft_greedy(base, adapters["c"], PROMPT, 5), skip_special_tokens=True).strip()
    bad = load(dict(lora_name="d", lora_path=str(tmp_path)))
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    missing = load(dict(lora_name="d", lora_path=str(tmp_path / "nowhere")))
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_path", missing.text
    big = load(dict(lora_name="d", lora_path=make_adapter(str(tmp_path / "r32"), base, r=32, alpha=32, seed=9)))
    assert big.status_code == 400 and "LoRA rank 32 is greater than max_lora_rank 16" in big.json()["error"]["message"]
    gone = httpx.post(srv.url + "/v1/unload_lora_adapter", json=dict(lora_name="c"))
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'c' removed successfully.", gone.text
    assert _tokens(srv, "c").status_code == 404
    assert httpx.post(srv.url + "/v1/unload_lora_adapter", json=dict(lora_name="c")).status_code == 404


def test_load_inplace_replaces_an_adapter(setup, tmp_path):
    """vLLM's `load_inplace`: a name in use is served by the new adapter; without it the name stays taken."""
    srv, base, adapters = setup
    load = lambda body: httpx.post(srv.url + "/v1/load_lora_adapter", json=body, timeout=60)  # noqa: E731
    assert load(dict(lora_name="swap", lora_path=adapters["a"])).status_code == 200
    taken = load(dict(lora_name="swap", lora_path=adapters["c"], load_inplace=False))
    assert taken.status_code == 400 and "has already been loaded" in taken.json()["error"]["message"]
    bad = load(dict(lora_name="swap", lora_path=adapters["c"], load_inplace="yes"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "load_inplace", bad.text
    ok = load(dict(lora_name="swap", lora_path=adapters["c"], load_inplace=True))
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'swap' added successfully.", ok.text
    from transformers import AutoTokenizer
    want = AutoTokenizer.from_pretrained(base).decode(peft_greedy(base, adapters["c"], PROMPT, 5),
                                                      skip_special_tokens=True)
    assert _tokens(srv, "swap").json()["choices"][0]["text"].strip() == want.strip()
    refused = load(dict(lora_name="swap", lora_path=str(tmp_path), load_inplace=True))  # no adapter_config.json
    assert refused.status_code == 400 and "adapter_config.json" in refused.json()["error"]["message"]
    assert _tokens(srv, "swap").json()["choices"][0]["text"].strip() == want.strip()  # the name keeps c
    assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]].count("swap") == 1
    assert httpx.post(srv.url + "/v1/unload_lora_adapter", json=dict(lora_name="swap")).status_code == 200
