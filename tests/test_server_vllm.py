"""vLLM's server behaviours (issue #36, the observed incompatibilities), against a live server over a tiny
model with a byte-level BPE tokenizer: prompt_logprobs present as null, /v1/models' root and parent, a
named tool call's content "", no partial tool calls when max_tokens cuts the output."""
import httpx
import pytest
from test_server import Server
from test_server_stall import make_byte_tokenizer

from jaxpaged.bench.tiny_models import make_tiny_model
from serve import tools

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(compile_cache, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("vllm_model"))
    make_tiny_model(d, "llama", vocab_size=320)
    make_byte_tokenizer(d)
    srv = Server(d, compile_cache, str(tmp_path_factory.mktemp("logs") / "vllm.log"),
                 extra=("--max-model-len", "512"))  # the tools, rendered into the prompt, take ~350 tokens
    srv.model_dir = d
    yield srv
    srv.stop()


def post(server, path, **body):
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_logprobs_present_as_null(server):
    r = post(server, "/v1/completions", prompt="ab", max_tokens=2)
    assert "prompt_logprobs" in r["choices"][0] and r["choices"][0]["prompt_logprobs"] is None
    r = post(server, "/v1/chat/completions", messages=USER, max_tokens=2)
    assert "prompt_logprobs" in r and r["prompt_logprobs"] is None


def test_models_root_and_parent(server):
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == "tiny" and card["root"] == server.model_dir
    assert "parent" in card and card["parent"] is None


def test_named_tool_call_content_is_empty_string():
    content, calls = tools.parse("named", '{"city": "Paris"}', "f")
    assert content == "" and calls[0].function.name == "f" and calls[0].function.arguments == '{"city": "Paris"}'


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "f"}}, "required"])
def test_no_partial_tool_calls_on_length(server, tool_choice):
    r = post(server, "/v1/chat/completions", messages=USER, tools=[TOOL], tool_choice=tool_choice, max_tokens=3)
    c = r["choices"][0]
    assert c["finish_reason"] == "length" and not c["message"].get("tool_calls"), c
    assert c["message"]["content"]  # the cut text stays content
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": USER, "tools": [TOOL], "tool_choice": "required",
                            "max_tokens": 3, "stream": True}) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks and all('"tool_calls":[' not in c for c in chunks)


def test_every_invalid_logit_bias_key_named(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "ab", "max_tokens": 1, "logit_bias": {"5": 1, "400": 1, "999": -1}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and "token ids 400, 999 are out of vocabulary" in err["message"], err
