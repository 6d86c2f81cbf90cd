"""vLLM's server behaviours (issue #36, the observed incompatibilities), against a live server over a tiny
model with a byte-level BPE tokenizer: prompt_logprobs present as null, /v1/models' root and parent, a
named tool call's content "", no partial tool calls when max_tokens cuts the output, legacy top_logprobs
with logprobs 0, prompt_tokens_details, logprobs -1 and --max-logprobs, ... One server with the default
flags (`server`), one with vLLM's opt-in flags (`flagged`)."""
import asyncio
import concurrent.futures
import json
import math
import re
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from test_server import Server
from test_server_stall import make_byte_tokenizer

from jaxpaged.testing.tiny_models import make_tiny_model
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


@pytest.fixture(scope="module")
def flagged(compile_cache, server, tmp_path_factory):
    """The same model, served with the opt-in flags these tests need (one server for all of them)."""
    srv = Server(server.model_dir, compile_cache, str(tmp_path_factory.mktemp("logs") / "vllm_flags.log"),
                 extra=("--max-model-len", "512", "--enable-prompt-tokens-details", "--max-logprobs", "400",
                        "--enable-tokenizer-info-endpoint", "--enable-force-include-usage",
                        "--return-tokens-as-token-ids", "--enable-server-load-tracking"))
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
    assert c["finish_reason"] == "length" and c["message"]["tool_calls"] is None, c  # absent, as vLLM's
    assert c["message"]["content"]  # the cut text stays content
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": USER, "tools": [TOOL], "tool_choice": "required",
                            "max_tokens": 3, "stream": True}) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks and all('"tool_calls":[' not in c for c in chunks)


def test_auto_tool_call_streams_as_deltas(server):
    """tool_choice auto (the server's default parser, hermes) over an answer forced by a regex to some text then
    a call: streamed, the text comes before the end as content, the call's id, type and name in its first delta
    entry and its arguments in pieces after it, as vLLM streams them; put together, the deltas equal the
    non-streamed message (content, call, finish_reason tool_calls)."""
    answer = 'Hi. <tool_call>{"name": "f", "arguments": {"city": "Paris"}}</tool_call>'
    body = dict(messages=USER, tools=[TOOL], tool_choice="auto", max_tokens=120, temperature=0,
                structured_outputs={"regex": answer.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")})
    whole = post(server, "/v1/chat/completions", **body)["choices"][0]
    call = whole["message"]["tool_calls"][0]["function"]
    assert (whole["finish_reason"], whole["message"]["content"], call) == (
        "tool_calls", "Hi.", {"name": "f", "arguments": '{"city": "Paris"}'}), whole
    deltas = [c["choices"][0] for c in stream(server, "/v1/chat/completions", **body) if c["choices"]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert content == "Hi." and {t["index"] for t in calls} == {0} and len(calls) > 2  # the arguments in pieces
    assert (calls[0]["type"], calls[0]["function"]["name"]) == ("function", "f") and calls[0]["id"]
    assert all(not t.get("id") and not t["function"].get("name") for t in calls[1:])
    assert "".join(t["function"]["arguments"] for t in calls) == call["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not deltas[-1]["delta"].get("content")  # the text before the call went out before the end


def test_every_invalid_logit_bias_key_named(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "ab", "max_tokens": 1, "logit_bias": {"5": 1, "400": 1, "999": -1}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and "token ids 400, 999 are out of vocabulary" in err["message"], err


def test_vllm_messages(server):
    """vLLM's words for: a seed past int64 (pydantic's less_than_equal / greater_than_equal), logit_bias keys
    that are not token ids (every one named), an empty prompt_embeds list (none: a prompt is still needed)."""
    assert "[type=less_than_equal]" in refused(server, "/v1/completions", prompt="ab", seed=2 ** 63)["message"]
    assert "[type=greater_than_equal]" in refused(server, "/v1/completions", prompt="ab", seed=-2 ** 63 - 1)["message"]
    post(server, "/v1/completions", prompt="ab", max_tokens=1, seed=2 ** 63 - 1)
    err = refused(server, "/v1/chat/completions", messages=USER, logit_bias={"bad1": 50, "bad2": 20, "7": 1})
    assert err["param"] == "logit_bias" and "bad1" in err["message"] and "bad2" in err["message"], err
    err = refused(server, "/v1/completions", prompt=None, prompt_embeds=[], max_tokens=1)
    assert err["message"] == "Either prompt or prompt_embeds must be provided and non-empty.", err
    assert post(server, "/v1/completions", prompt="ab", prompt_embeds=[], max_tokens=1)["choices"][0]["index"] == 0


def refused(server, path, **body) -> dict:
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_completion_logprobs_zero_is_the_chosen_token(server):
    r = post(server, "/v1/completions", prompt="ab", max_tokens=3, logprobs=0, temperature=0, ignore_eos=True)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 3
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {tok: v}, (tok, v, top)
    r = post(server, "/v1/completions", prompt="abc", max_tokens=2, logprobs=0, echo=True, ignore_eos=True)
    lp = r["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"]) == 5
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top == {tok: v}, (tok, v, top)


def test_completion_top_logprobs_hold_the_chosen_token_first(server):
    """As vLLM's: the chosen (or prompt) token, then the top k: max(k, 1) to k + 1 entries."""
    r = post(server, "/v1/completions", prompt="abc", max_tokens=4, logprobs=2, echo=True, temperature=1.5,
             seed=3, ignore_eos=True)
    lp = r["choices"][0]["logprobs"]
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert 1 <= len(top) <= 3 and next(iter(top)) == tok and top[tok] == v, (tok, v, top)
        rest = list(top.values())[1:]
        assert rest == sorted(rest, reverse=True)  # then by rank


def test_prompt_tokens_details_only_with_the_flag(server, flagged):
    usage = post(server, "/v1/completions", prompt="x" * 40, max_tokens=1)["usage"]
    assert "prompt_tokens_details" in usage and usage["prompt_tokens_details"] is None
    chat = post(server, "/v1/chat/completions", messages=USER, max_tokens=1)["usage"]
    assert chat["prompt_tokens_details"] is None
    client = openai.OpenAI(base_url=flagged.url + "/v1", api_key="EMPTY", max_retries=0, timeout=60)
    prompt = "the prefix cache serves this prompt's full blocks" * 2
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details.cached_tokens >= 16 * (len(prompt) // 16 - 1)
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=1, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_logprobs_minus_one_and_max_logprobs(server, flagged):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, logprobs=True, top_logprobs=-1)
    assert [len(t.top_logprobs) for t in r.choices[0].logprobs.content] == [20, 20]  # --max-logprobs 20
    r = post(server, "/v1/completions", prompt="ab", max_tokens=1, logprobs=-1)
    assert len(r["choices"][0]["logprobs"]["top_logprobs"][0]) >= 10  # 20 ids, some of one text
    err = refused(server, "/v1/chat/completions", messages=USER, logprobs=True, top_logprobs=21)
    assert err["param"] == "top_logprobs" and "max_logprobs (20)" in err["message"], err
    err = refused(server, "/v1/completions", prompt="ab", logprobs=21)
    assert err["param"] == "logprobs" and "max_logprobs (20)" in err["message"], err
    assert refused(server, "/v1/completions", prompt="ab", logprobs=-2)["param"] == "logprobs"
    # --max-logprobs 400 over a vocabulary of 320: -1 is the whole vocabulary; 25 is no longer refused
    r = post(flagged, "/v1/chat/completions", messages=USER, max_tokens=1, logprobs=True, top_logprobs=-1)
    top = r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == 320 and sum(math.exp(t["logprob"]) for t in top) == pytest.approx(1, abs=1e-3)
    r = post(flagged, "/v1/chat/completions", messages=USER, max_tokens=1, logprobs=True, top_logprobs=25)
    assert len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    err = refused(flagged, "/v1/chat/completions", messages=USER, logprobs=True, top_logprobs=321)
    assert err["param"] == "top_logprobs" and "max_logprobs (320)" in err["message"], err


def test_lax_types_as_vllm(server):
    """pydantic's lax mode, as vLLM's request models: numbers and booleans written as strings, 2.0 for 2."""
    r = post(server, "/v1/chat/completions", messages=USER, logprobs="true", top_logprobs="2", max_tokens="5",
             temperature="0.5", ignore_eos="yes", seed=7.0)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(t["top_logprobs"]) == 2 for t in content)
    r = post(server, "/v1/completions", prompt=[97, 98.0], max_tokens=3.0, n="1", temperature=0, ignore_eos=1)
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                          "prompt_tokens_details": None}
    for body, param, words in (
            ({"max_tokens": "five"}, "max_tokens", "[type=int_parsing]"),
            ({"max_tokens": 2.5}, "max_tokens", "[type=int_from_float]"),
            ({"max_tokens": -1}, "max_tokens", "Input should be greater than or equal to 0 [type=greater_than_equal]"),
            ({"temperature": "hot"}, "temperature", "[type=float_parsing]"),
            ({"stop": 5}, "stop", "[type=string_type]"),
            ({"echo": "maybe"}, "echo", "[type=bool_parsing]"),
            ({"prompt": [97, "b"]}, "prompt", "must be a non-empty string")):
        err = refused(server, "/v1/completions", **{"prompt": "ab", **body})
        assert err["param"] == param and words in err["message"], (body, err)


UNIT_TOOL = {"type": "function", "function": {"name": "g", "parameters": {
    "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "required": ["u"], "additionalProperties": False,
    "$defs": {"Unit": {"enum": ["c"]}}}}}
NESTED_TOOL = {"type": "function", "function": {"name": "h", "parameters": {
    "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"},
                                     "kids": {"type": "array", "items": {"$ref": "#/definitions/Person"}}},
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}},
    "definitions": {"Person": {"type": "object", "properties": {"home": {"$ref": "#/$defs/Address"},
                                                                "next": {"$ref": "#/definitions/Person"}}}}}}}


def test_required_tools_with_defs_compile():
    """Each tool's definitions are lifted to the combined schema's root, its references rewritten."""
    from serve.protocol import ChatCompletionRequest
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [TOOL, UNIT_TOOL, NESTED_TOOL],
                                                "tool_choice": "required"})
    engine = SimpleNamespace(prepare_structured=lambda so: None)  # the grammar check alone, no tokenizer
    so, mode, _ = asyncio.run(tools.constraint(req, engine))
    defs = so.json["$defs"]
    assert mode == "required" and set(defs) == {"tool1", "tool1.Unit", "tool2", "tool2.Address", "tool2.Person"}
    assert defs["tool2.Person"]["properties"]["next"] == {"$ref": "#/$defs/tool2.Person"}
    assert defs["tool2"]["properties"]["home"] == {"$ref": "#/$defs/tool2.Address"}
    assert so.json["items"]["anyOf"][0]["properties"]["arguments"] == TOOL["function"]["parameters"]


def test_required_tool_with_defs_served(server):
    for tool_choice in ("required", {"type": "function", "function": {"name": "g"}}):
        r = post(server, "/v1/chat/completions", messages=USER, tools=[UNIT_TOOL], tool_choice=tool_choice,
                 temperature=0)  # byte-level tokens: the tool in the prompt leaves ~100 of max_model_len
        c = r["choices"][0]
        assert c["finish_reason"] in ("tool_calls", "stop"), c
        assert [json.loads(t["function"]["arguments"]) for t in c["message"]["tool_calls"]] == [{"u": "c"}], c


def test_tokenize_detokenize_version(server, flagged):
    hi = post(server, "/tokenize", prompt="hi", return_token_strs="true")
    assert hi["count"] == len(hi["tokens"]) == 2 and hi["max_model_len"] == 512 and hi["token_strs"] == ["h", "i"]
    chat = post(server, "/v1/chat/completions", messages=USER, max_tokens=1)["usage"]["prompt_tokens"]
    r = post(server, "/tokenize", messages=USER)
    assert r["count"] == chat == len(r["tokens"]) and r["token_strs"] is None
    bare = post(server, "/tokenize", messages=USER, add_generation_prompt=False)
    assert bare["count"] < r["count"] and r["tokens"][:bare["count"]] == bare["tokens"]
    assert post(server, "/detokenize", tokens=r["tokens"])["prompt"].endswith("<|im_start|>assistant ")
    assert post(server, "/detokenize", tokens=hi["tokens"]) == {"prompt": "hi"}
    err = refused(server, "/tokenize", prompt="x" * 9000)  # refused from its size (a prefix), not tokenized whole
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
    assert refused(server, "/detokenize", tokens=[5, 999])["param"] == "tokens"
    assert refused(server, "/detokenize", tokens="hi")["param"] == "tokens"
    assert refused(server, "/tokenize", prompt=5)["param"] == "prompt"
    assert httpx.post(server.url + "/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404
    from jaxpaged import __version__
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404  # only with the flag
    info = httpx.get(flagged.url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and "im_start" in info["chat_template"] and info["model_max_length"] == 512
    paths = httpx.get(flagged.url + "/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize", "/version", "/tokenizer_info"} <= set(paths)
    assert "/tokenizer_info" not in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_vllm_tool_flags(capsys):
    """vLLM's tool flags: --tool-call-parser hermes (the default syntax) and --enable-auto-tool-choice are
    accepted, a parser not served here is refused with the choices."""
    import argparse

    from serve.app import add_serve_args
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    args = parse(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    assert args.tool_call_parser == "hermes" and args.enable_auto_tool_choice
    assert parse([]).tool_call_parser is None
    with pytest.raises(SystemExit) as e:
        parse(["--tool-call-parser", "granite"])
    assert e.value.code == 2 and "hermes" in capsys.readouterr().err


def test_reasoning_parser_flag_names_its_choices(capsys):
    import argparse

    from serve.app import add_serve_args
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert parse([]).reasoning_parser is None and parse(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        parse(["--reasoning-parser", "hermes"])
    err = capsys.readouterr().err
    assert "deepseek_r1" in err and "qwen3" in err, err


def stream(server, path, **body) -> list[dict]:
    with httpx.stream("POST", server.url + path, timeout=120, json={"model": "tiny", "stream": True, **body}) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_return_token_ids(server):
    r = post(server, "/v1/completions", prompt=[97, 98], max_tokens=3, temperature=0, ignore_eos=True,
             return_token_ids=True)
    c = r["choices"][0]
    assert c["prompt_token_ids"] == [97, 98] and len(c["token_ids"]) == 3 == r["usage"]["completion_tokens"]
    assert post(server, "/detokenize", tokens=c["token_ids"])["prompt"] == c["text"]
    r = post(server, "/v1/completions", prompt=["ab", "cd"], max_tokens=2, n=2, return_token_ids=True)
    assert [ch["prompt_token_ids"] for ch in r["choices"]] == [post(server, "/tokenize", prompt=p)["tokens"]
                                                              for p in ("ab", "ab", "cd", "cd")]
    plain = post(server, "/v1/completions", prompt="ab", max_tokens=2)["choices"][0]
    assert plain["prompt_token_ids"] is None and plain["token_ids"] is None  # not asked: null
    chunks = stream(server, "/v1/completions", prompt=[97, 98], max_tokens=3, temperature=0, ignore_eos=True,
                    return_token_ids=True)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [97, 98]
    assert all(ch["choices"][0]["prompt_token_ids"] is None for ch in chunks[1:])
    assert sum((ch["choices"][0]["token_ids"] for ch in chunks), []) == c["token_ids"]
    r = post(server, "/v1/chat/completions", messages=USER, max_tokens=3, temperature=0, return_token_ids=True)
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"] and len(r["choices"][0]["token_ids"]) == \
        r["usage"]["completion_tokens"]
    chunks = stream(server, "/v1/chat/completions", messages=USER, max_tokens=3, temperature=0, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert sum((ch["choices"][0]["token_ids"] or [] for ch in chunks[1:]), []) == r["choices"][0]["token_ids"]
    # as vLLM's: every choice of the stream carries a list (the role chunk's empty), no chunk but the first
    # has prompt_token_ids, with tools too
    for body in ({}, {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "required"}):
        chunks = stream(server, "/v1/chat/completions", messages=USER, max_tokens=3, temperature=0,
                        return_token_ids=True, **body)
        assert chunks[0]["choices"][0]["token_ids"] == [] and all("prompt_token_ids" not in ch for ch in chunks[1:])
        assert all(isinstance(x["token_ids"], list) for ch in chunks for x in ch["choices"]), (body, chunks)
        assert len(sum((x["token_ids"] for ch in chunks for x in ch["choices"]), [])) == 3, body
    assert "prompt_token_ids" not in stream(server, "/v1/chat/completions", messages=USER, max_tokens=1)[0]


def test_truncate_prompt_tokens(server):
    ids = list(range(97, 117))
    for side, kept in ((None, ids[-5:]), ("left", ids[-5:]), ("right", ids[:5])):
        r = post(server, "/v1/completions", prompt=ids, max_tokens=1, truncate_prompt_tokens=5, truncation_side=side,
                 return_token_ids=True)
        assert r["choices"][0]["prompt_token_ids"] == kept and r["usage"]["prompt_tokens"] == 5, (side, r)
    assert refused(server, "/v1/completions", prompt="x" * 9000, max_tokens=1)["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", prompt="ab" * 4500, max_tokens=1, truncate_prompt_tokens=10, echo=True)
    assert r["usage"]["prompt_tokens"] == 10 and r["choices"][0]["text"].startswith("ab" * 5)  # the kept tokens
    r = post(server, "/v1/completions", prompt="x" * 9000, max_tokens=2, truncate_prompt_tokens=-1)
    assert r["usage"]["prompt_tokens"] == 510  # max_model_len - max_tokens
    err = refused(server, "/v1/completions", prompt="ab", truncate_prompt_tokens=513)
    assert err["param"] == "truncate_prompt_tokens" and "max_model_len" in err["message"], err
    assert refused(server, "/v1/completions", prompt="ab", truncate_prompt_tokens=-2)["param"] == \
        "truncate_prompt_tokens"
    assert refused(server, "/v1/completions", prompt="ab", truncation_side="middle")["param"] == "truncation_side"
    r = post(server, "/v1/chat/completions", messages=USER, max_tokens=1, truncate_prompt_tokens=3)
    assert r["usage"]["prompt_tokens"] == 3


def test_prompt_logprobs_request_field(server):
    r = post(server, "/v1/completions", prompt="abc", max_tokens=1, prompt_logprobs=2, return_token_ids=True)
    plp, ids = r["choices"][0]["prompt_logprobs"], r["choices"][0]["prompt_token_ids"]
    echo = post(server, "/v1/completions", prompt="abc", max_tokens=1, logprobs=2, echo=True)["choices"][0]["logprobs"]
    assert plp[0] is None and len(plp) == len(ids) == 3
    for tok_id, entry, v, s in zip(ids[1:], plp[1:], echo["token_logprobs"][1:3], "bc"):
        assert next(iter(entry)) == str(tok_id) and entry[str(tok_id)]["logprob"] == pytest.approx(v, abs=1e-5)
        assert entry[str(tok_id)]["decoded_token"] == s and 2 <= len(entry) <= 3
        ranked = sorted((e for e in entry.values() if e["rank"] is not None), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2]  # the top 2; the prompt token's rank null outside them
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
    r = post(server, "/v1/chat/completions", messages=USER, max_tokens=1, prompt_logprobs=0, return_token_ids=True)
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == len(r["prompt_token_ids"])
    assert [list(e) for e in r["prompt_logprobs"][1:]] == [[str(t)] for t in r["prompt_token_ids"][1:]]
    assert post(server, "/v1/chat/completions", messages=USER, max_tokens=1)["prompt_logprobs"] is None
    err = refused(server, "/v1/completions", prompt="ab", prompt_logprobs=1, stream=True)
    assert err["param"] == "prompt_logprobs" and "stream" in err["message"], err
    err = refused(server, "/v1/chat/completions", messages=USER, prompt_logprobs=21)
    assert err["param"] == "prompt_logprobs" and "max_logprobs (20)" in err["message"], err


def test_return_tokens_as_token_ids(server, flagged):
    r = post(server, "/v1/completions", prompt="ab", max_tokens=3, logprobs=1, return_tokens_as_token_ids=True,
             return_token_ids=True, ignore_eos=True)
    c = r["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for k in top)
    r = post(server, "/v1/chat/completions", messages=USER, max_tokens=2, logprobs=True, top_logprobs=2,
             return_tokens_as_token_ids=True, return_token_ids=True)
    content, ids = r["choices"][0]["logprobs"]["content"], r["choices"][0]["token_ids"]
    assert [t["token"] for t in content] == [f"token_id:{t}" for t in ids]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    plain = post(server, "/v1/completions", prompt="ab", max_tokens=1, logprobs=0)["choices"][0]["logprobs"]
    assert not plain["tokens"][0].startswith("token_id:")
    flag = post(flagged, "/v1/completions", prompt="ab", max_tokens=1, logprobs=0)["choices"][0]["logprobs"]
    assert flag["tokens"][0].startswith("token_id:")  # --return-tokens-as-token-ids
    off = post(flagged, "/v1/completions", prompt="ab", max_tokens=1, logprobs=0, return_tokens_as_token_ids=False)
    assert not off["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_continuous_usage_stats_and_force_include_usage(server, flagged):
    for path, body in (("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", {"messages": USER})):
        chunks = stream(server, path, max_tokens=4, ignore_eos=True, **body,
                        stream_options={"include_usage": True, "continuous_usage_stats": True})
        assert all(ch["usage"] is not None for ch in chunks), chunks
        done = [ch["usage"]["completion_tokens"] for ch in chunks]
        assert done == sorted(done) and done[-1] == 4 and chunks[-1]["choices"] == []
        assert len({ch["usage"]["prompt_tokens"] for ch in chunks}) == 1
        chunks = stream(server, path, max_tokens=2, **body, stream_options={"include_usage": True})
        assert [ch["usage"] is not None for ch in chunks] == [False] * (len(chunks) - 1) + [True]
        assert all(ch["usage"] is None for ch in stream(server, path, max_tokens=2, **body))
        forced = stream(flagged, path, max_tokens=2, **body)  # --enable-force-include-usage: both, as vLLM's
        assert forced[-1]["choices"] == [] and forced[-1]["usage"]["completion_tokens"] <= 2
        done = [ch["usage"]["completion_tokens"] for ch in forced]
        assert done == sorted(done) and all(ch["usage"]["total_tokens"] == ch["usage"]["prompt_tokens"] + n
                                            for ch, n in zip(forced, done))


def test_allowed_token_ids(server):
    r = post(server, "/v1/completions", prompt="ab", max_tokens=3, ignore_eos=True, allowed_token_ids=[100, 120],
             return_token_ids=True)
    assert set(r["choices"][0]["token_ids"]) <= {100, 120}
    err = refused(server, "/v1/completions", prompt="ab", allowed_token_ids=[5, 400])
    assert err["param"] == "allowed_token_ids" and "400" in err["message"], err
    assert refused(server, "/v1/chat/completions", messages=USER, allowed_token_ids=[])["param"] == "allowed_token_ids"


CONT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]


def test_chat_echo_generation_prompt_continue_and_custom_roles(server):
    base = post(server, "/v1/chat/completions", messages=USER, max_tokens=3, temperature=0, return_token_ids=True)
    assert post(server, "/detokenize", tokens=base["prompt_token_ids"])["prompt"].endswith("<|im_start|>assistant ")
    same = post(server, "/v1/chat/completions", messages=USER, max_tokens=3, temperature=0, echo=True)
    assert same["choices"][0]["message"]["content"] == base["choices"][0]["message"]["content"]  # user last: no echo
    bare = post(server, "/v1/chat/completions", messages=CONT, max_tokens=3, add_generation_prompt=False,
                return_token_ids=True)
    assert post(server, "/detokenize", tokens=bare["prompt_token_ids"])["prompt"].endswith("Hel<|im_end|>")
    cont = post(server, "/v1/chat/completions", messages=CONT, max_tokens=3, temperature=0, echo=True,
                add_generation_prompt=False, continue_final_message=True, return_token_ids=True)
    assert post(server, "/detokenize", tokens=cont["prompt_token_ids"])["prompt"].endswith("assistant Hel")
    msg = cont["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].startswith("Hel")  # echo: the last message's content
    chunks = stream(server, "/v1/chat/completions", messages=CONT, max_tokens=3, temperature=0, echo=True,
                    add_generation_prompt=False, continue_final_message=True)
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == msg["content"]
    err = refused(server, "/v1/chat/completions", messages=CONT, continue_final_message=True)
    assert err["param"] == "continue_final_message" and err["code"] == "invalid_combination", err
    custom = [{"role": "narrator", "content": "once"}, {"role": "user", "content": "hi"}]
    r = post(server, "/v1/chat/completions", messages=custom, max_tokens=1, return_token_ids=True)
    assert "<|im_start|>narrator once" in post(server, "/detokenize", tokens=r["prompt_token_ids"])["prompt"]
    r = post(server, "/v1/chat/completions", messages=custom, max_tokens=1, add_generation_prompt=False, echo=True)
    assert r["choices"][0]["message"]["role"] == "user" and r["choices"][0]["message"]["content"].startswith("hi")
    assert refused(server, "/v1/chat/completions", messages=[{"role": "", "content": "x"}])["param"] == "messages"
    assert refused(server, "/v1/chat/completions", messages=[{"role": "narrator"}])["param"] == "messages"


def test_invocations_routes_by_body(server):
    chat = post(server, "/invocations", messages=USER, max_tokens=2, temperature=0)
    assert chat["object"] == "chat.completion" and chat == {**post(server, "/v1/chat/completions", messages=USER,
                                                                   max_tokens=2, temperature=0),
                                                            "id": chat["id"], "created": chat["created"]}
    cmpl = post(server, "/invocations", prompt="ab", max_tokens=2, temperature=0)
    assert cmpl["object"] == "text_completion" and cmpl["choices"][0]["text"] == post(
        server, "/v1/completions", prompt="ab", max_tokens=2, temperature=0)["choices"][0]["text"]
    chunks = stream(server, "/invocations", prompt="ab", max_tokens=2)
    assert chunks and all(ch["object"] == "text_completion" for ch in chunks)
    err = refused(server, "/invocations", max_tokens=2)
    assert "messages" in err["message"] and "prompt" in err["message"], err
    assert refused(server, "/invocations", messages=[])["param"] == "messages"  # a chat request's own checks
    assert httpx.post(server.url + "/invocations", json={"model": "nope", "prompt": "a"}).status_code == 404
    assert "/invocations" in httpx.get(server.url + "/openapi.json").json()["paths"]


def test_request_histograms_as_vllm(server):
    def scrape():
        text = httpx.get(server.url + "/metrics").text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith("jaxpaged:")}
    before = scrape()
    post(server, "/v1/completions", prompt=[97, 98, 99], max_tokens=4, n=2, ignore_eos=True)
    after = scrape()

    def grew(name):
        return after[name] - before.get(name, 0)
    tiny = 'model_name="tiny"'
    assert grew(f"jaxpaged:request_prompt_tokens_sum{{{tiny}}}") == 3
    assert grew(f"jaxpaged:request_generation_tokens_sum{{{tiny}}}") == 8  # both samples
    assert grew(f'jaxpaged:request_generation_tokens_bucket{{le="5.0",{tiny}}}') == 0
    assert grew(f'jaxpaged:request_generation_tokens_bucket{{le="10.0",{tiny}}}') == 1
    assert grew(f"jaxpaged:request_params_n_sum{{{tiny}}}") == 2
    assert grew(f"jaxpaged:request_params_max_tokens_sum{{{tiny}}}") == 4
    assert f'jaxpaged:request_params_max_tokens_bucket{{le="500.0",{tiny}}}' in after  # 1-2-5 up to max_model_len
    assert f'jaxpaged:request_params_max_tokens_bucket{{le="1000.0",{tiny}}}' not in after


def test_phase_and_iteration_histograms_as_vllm(server):
    """vLLM's request phase histograms (queue, prefill, decode, inference), inter-token latency and tokens per
    engine step, from the engine's own timestamps; the gauges carry vLLM's engine label."""
    def scrape():
        text = httpx.get(server.url + "/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("jaxpaged:")}
    before = scrape()
    post(server, "/v1/completions", prompt=[97, 98, 99], max_tokens=4, ignore_eos=True)
    after = scrape()

    def grew(name):
        return after[name] - before.get(name, 0)
    tiny = '{model_name="tiny"}'
    for phase in ("queue", "prefill", "decode", "inference"):
        assert grew(f"jaxpaged:request_{phase}_time_seconds_count{tiny}") == 1, phase
        assert grew(f"jaxpaged:request_{phase}_time_seconds_sum{tiny}") >= 0, phase
    assert grew('jaxpaged:request_queue_time_seconds_bucket{le="7680.0",model_name="tiny"}') == 1
    assert grew(f"jaxpaged:inter_token_latency_seconds_count{tiny}") == 3  # 4 tokens, one a step
    e2e = grew(f"jaxpaged:e2e_request_latency_seconds_sum{tiny}")
    inference = grew(f"jaxpaged:request_inference_time_seconds_sum{tiny}")
    assert inference <= e2e + 1e-6
    assert abs(grew(f"jaxpaged:request_prefill_time_seconds_sum{tiny}")
               + grew(f"jaxpaged:request_decode_time_seconds_sum{tiny}") - inference) < 1e-6
    eng = '{engine="0",model_name="tiny",replica="0"}'  # prometheus_client writes labels sorted
    assert grew(f"jaxpaged:iteration_tokens_total_count{eng}") >= 4  # a prefill step and 3 decodes at least
    assert grew(f"jaxpaged:iteration_tokens_total_sum{eng}") >= 3 + 3
    assert f"jaxpaged:num_requests_running{eng}" in after and f"jaxpaged:num_requests_waiting{eng}" in after
    big = '{engine="0",le="+Inf",model_name="tiny",replica="0"}'
    assert after[f"jaxpaged:iteration_tokens_total_bucket{big}"] == after[f"jaxpaged:iteration_tokens_total_count{eng}"]


def test_iteration_tokens_sum_as_vllm(server):
    """vLLM's count (its test_metrics_counts): one observation per step that gave tokens, of the step's new
    tokens plus the computed prompt tokens of the requests it gave their first: requests x max_tokens steps,
    requests x (prompt + max_tokens) tokens, for requests one after another. vLLM's request_num_preemptions
    (one per finished request) and cache_config_info (its labels) beside it."""
    eng, tiny = '{engine="0",model_name="tiny",replica="0"}', '{model_name="tiny"}'
    names = (f"jaxpaged:iteration_tokens_total_count{eng}", f"jaxpaged:iteration_tokens_total_sum{eng}",
             f"jaxpaged:request_num_preemptions_count{tiny}", f"jaxpaged:request_num_preemptions_sum{tiny}")

    def scrape():
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        return {n: float(line.rsplit(" ", 1)[1]) for line in lines for n in names if line.startswith(n + " ")}, lines
    before, _ = scrape()
    for i in range(3):
        post(server, "/v1/completions", prompt=[60 + i, 61, 62, 63, 64, 65, 66, 67, 68], max_tokens=5, ignore_eos=True)
    after, lines = scrape()
    grew = [after[n] - before.get(n, 0) for n in names]
    assert grew == [3 * 5, 3 * (9 + 5), 3, 0], grew
    info = [line for line in lines if line.startswith("jaxpaged:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and info[0].endswith(" 1.0"), info
    size = int(info[0].split('kv_cache_size_tokens="')[1].split('"')[0])
    assert size > 0 and f'kv_cache_max_concurrency="{size / 512}"' in info[0], info


# -- reasoning parsers (serve/reasoning.py) ------------------------------------------------------------------
REASONING_TEXTS = ["", "plain answer", "<think>", "<think>why</think>", "<think>why</think>answer",
                   "<think>\nwhy < because </thin k></think>\n\nthe answer </think> stays", "why</think>answer",
                   "why</think>", "<thi", "<think>cut before the end </thi", "a <think>b</think>c", "</think>x",
                   "<<think>x</think>y", "<think><think>x</think>y", "why </th", "ü<think>é</think>ñ"]


def _streamed(parser, pieces):
    s, thought, content = parser.stream(), "", ""
    for p in pieces:
        t, c = s.feed(p)
        thought, content = thought + t, content + c
    t, c = s.finish()
    return thought + t, content + c


def _splits(text):
    """The text cut into pieces every way that matters: whole, at every position, at every two positions,
    one character a piece."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_reasoning_stream_matches_the_whole_split(name):
    from serve.reasoning import END, START, make_parser
    parser = make_parser(name)
    for text in REASONING_TEXTS:
        thought, content = parser.split(text)
        want = (thought or "", content or "")
        if name == "qwen3" and text.startswith(START) and END not in text:  # a stream cut inside: reasoning sent
            want = (text[len(START):], "")
        for pieces in _splits(text):
            assert _streamed(parser, pieces) == want, (name, text, pieces)


def test_reasoning_parsers_as_vllm():
    from serve.reasoning import make_parser
    r1, qwen, none = make_parser("deepseek_r1"), make_parser("qwen3"), make_parser(None)
    assert r1.split("<think>why</think>answer") == ("why", "answer")
    assert r1.split("why</think>answer") == ("why", "answer")  # the template opened the thinking
    assert r1.split("why, cut by max_tokens") == ("why, cut by max_tokens", None)
    assert r1.split("<think>why</think>") == ("why", None)
    assert qwen.split("<think>why</think>\n\nanswer") == ("why", "\n\nanswer")
    assert qwen.split("no tags") == (None, "no tags")
    assert qwen.split("why</think>answer") == (None, "why</think>answer")  # both tags expected
    assert qwen.split("<think>cut") == (None, "<think>cut")
    assert none.split("<think>why</think>answer") == (None, "<think>why</think>answer") and not none.active
    assert _streamed(none, ["<think>a", "</think>b"]) == ("", "<think>a</think>b")
    with pytest.raises(ValueError, match="deepseek_r1"):
        make_parser("granite")


@pytest.fixture(scope="module")
def reasoning_server(compile_cache, server, tmp_path_factory):
    """The same model served with --reasoning-parser deepseek_r1."""
    srv = Server(server.model_dir, compile_cache, str(tmp_path_factory.mktemp("logs") / "vllm_reasoning.log"),
                 extra=("--max-model-len", "512", "--reasoning-parser", "deepseek_r1"))
    yield srv
    srv.stop()


def test_reasoning_parser_splits_the_answer(server, reasoning_server):
    """deepseek_r1: the output before </think> (all of it when there is none: the template opened the
    thinking) is message.reasoning_content and message.reasoning, the rest content; streamed as deltas of
    each; without the flag the fields are null."""
    from serve.reasoning import make_parser
    body = dict(messages=USER, max_tokens=12, temperature=0, ignore_eos=True)
    plain = post(server, "/v1/chat/completions", **body)["choices"][0]["message"]
    assert plain["reasoning_content"] is None and plain["reasoning"] is None
    thought, answer = make_parser("deepseek_r1").split(plain["content"])
    msg = post(reasoning_server, "/v1/chat/completions", **body)["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == thought and msg["content"] == answer, (plain, msg)
    deltas = [ch["choices"][0]["delta"] for ch in stream(reasoning_server, "/v1/chat/completions", **body)
              if ch["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == (answer or "")
    r = httpx.post(reasoning_server.url + "/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200 and "reasoning_content" not in r.json()["choices"][0]  # chat only, as vLLM


def test_constraint_applies_after_the_reasoning(reasoning_server):
    """As vLLM's: under a reasoning parser a constrained output (tool_choice named / required, response_format)
    applies to the answer after the reasoning, so the request is served; here the reasoning (all the output:
    deepseek_r1's template opened it) never ends within max_tokens, so the call is cut: no tool_calls at all,
    the text is reasoning, plain and streamed (the mask lets the model reason freely, in UTF-8 text)."""
    body = dict(messages=USER, max_tokens=12, temperature=0, ignore_eos=True)
    named = {"type": "function", "function": {"name": "f"}}
    for extra in ({"tools": [TOOL], "tool_choice": named}, {"tools": [TOOL], "tool_choice": "required"},
                  {"response_format": {"type": "json_object"}}):
        c = post(reasoning_server, "/v1/chat/completions", **body, **extra)["choices"][0]
        assert c["finish_reason"] == "length" and c["message"]["content"] is None, (extra, c)
        assert c["message"]["tool_calls"] == (None if "tools" in extra else []), (extra, c)
        assert c["message"]["reasoning"] and "\ufffd" not in c["message"]["reasoning"], c  # free text (UTF-8)
        deltas = [ch["choices"][0]["delta"] for ch in stream(reasoning_server, "/v1/chat/completions", **body,
                                                               **extra) if ch["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == c["message"]["reasoning"], extra
        assert sum(1 for d in deltas if d.get("reasoning")) > 1, (extra, deltas)  # as it comes, not at the end
        assert not any(d.get("tool_calls") or d.get("content") for d in deltas), (extra, deltas)


def test_iteration_tokens_counts_and_renders_per_engine():
    """IterationTokens' buckets (vLLM's; le is inclusive) and the histogram per replica, with vLLM's engine label."""
    from jaxpaged.core.iteration_stats import IterationTokens
    from serve.metrics import Metrics
    it = IterationTokens()
    for n in (1, 2, 8, 9, 20000):
        it.observe(n)
    snap = it.snapshot()
    assert snap["sum"] == 20020 and snap["counts"][:3] == [1, 2, 1] and snap["counts"][-1] == 1
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.0, num_preemptions=0,
                num_step_failures=0)
    other = IterationTokens()
    other.observe(3)
    per = [dict(base, iteration_tokens=snap), dict(base, iteration_tokens=other.snapshot())]
    engine = SimpleNamespace(stats=lambda: dict(base, iteration_tokens=snap, replicas=per))
    text = Metrics(engine, "tiny").render()[0].decode()
    assert 'jaxpaged:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="tiny",replica="0"} 3.0' in text
    assert 'jaxpaged:iteration_tokens_total_count{engine="0",model_name="tiny",replica="0"} 5.0' in text
    assert 'jaxpaged:iteration_tokens_total_sum{engine="1",model_name="tiny",replica="1"} 3.0' in text
    assert 'jaxpaged:iteration_tokens_total_bucket{engine="1",le="1.0",model_name="tiny",replica="1"} 0.0' in text


def load(server) -> int:
    r = httpx.get(server.url + "/load", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["server_load"]


def until_load(server, n: int) -> None:
    deadline = time.monotonic() + 30
    while load(server) != n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load(server) == n


def test_server_load(server, flagged):
    """GET /load as vLLM's: without --enable-server-load-tracking always 0; with it, the generation requests
    in flight (the engine paused holds them): a stream until it ends (here: its client goes away), a plain
    request until answered, a refused one not at all."""
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 2}
    for srv, one in ((server, 0), (flagged, 1)):
        assert load(srv) == 0
        assert httpx.post(srv.url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                plain = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=120)
                with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                                  json={"model": "tiny", "messages": USER, "stream": True}):
                    until_load(srv, 2 * one)
                until_load(srv, one)  # the stream's client went away
                httpx.post(srv.url + "/resume", timeout=30)
                assert plain.result().status_code == 200
        finally:
            httpx.post(srv.url + "/resume", timeout=30)
        until_load(srv, 0)
    refused(flagged, "/v1/chat/completions", messages=USER, n=0)
    post(flagged, "/v1/chat/completions/batch", messages=[USER, USER], max_tokens=2)
    post(flagged, "/invocations", prompt="ab", max_tokens=2)
    assert load(flagged) == 0


def test_batch_chat_completions(server):
    """vLLM's /v1/chat/completions/batch: one choice per conversation, each what the conversation alone gets
    (greedy; logprobs within float error), usage summed; stream, n > 1, tools and an empty conversation
    refused by name."""
    convs = [USER, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bonjour"}]]
    common = dict(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    r = post(server, "/v1/chat/completions/batch", messages=convs, return_token_ids=True, **common)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert [c["index"] for c in r["choices"]] == [0, 1]
    prompt_tokens = 0
    for conv, c in zip(convs, r["choices"]):
        alone = post(server, "/v1/chat/completions", messages=conv, **common)
        assert c["message"] == alone["choices"][0]["message"] and c["finish_reason"] == "length"
        got, want = c["logprobs"]["content"], alone["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in got] == [t["token"] for t in want] and len(c["token_ids"]) == 5
        assert all(math.isclose(a["logprob"], b["logprob"], abs_tol=1e-4) and len(a["top_logprobs"]) == 2
                   for a, b in zip(got, want))  # (batched: not bit for bit)
        prompt_tokens += alone["usage"]["prompt_tokens"]
    assert r["usage"]["prompt_tokens"] == prompt_tokens and r["usage"]["completion_tokens"] == 10
    for field, value in (("stream", True), ("n", 2), ("tools", [TOOL]), ("prompt_logprobs", 1)):
        assert refused(server, "/v1/chat/completions/batch", messages=convs, **{field: value})["param"] == field
    assert refused(server, "/v1/chat/completions/batch", messages=[USER, []])["param"] == "messages"
    assert refused(server, "/v1/chat/completions/batch", messages=USER)["param"] == "messages"


def test_logprob_token_ids(server, flagged):
    """vLLM's logprob_token_ids: each generated token's logprobs are its own, then those of the ids asked (in
    their order), equal to what the whole vocabulary shows (flagged: tokens as token_id:N, --max-logprobs 400);
    plain, streamed, legacy completions, batch chat; without logprobs, out of the vocabulary, more than 128
    (vLLM's bound) or empty: a 400 naming the field."""
    ids, named = [7, 65, 300, 65], ["token_id:7", "token_id:65", "token_id:300"]
    base = dict(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    full = post(flagged, "/v1/chat/completions", messages=USER, top_logprobs=-1, **base)
    r = post(flagged, "/v1/chat/completions", messages=USER, logprob_token_ids=ids, **base)
    got = r["choices"][0]["logprobs"]["content"]
    assert len(got) == 4
    for g, f in zip(got, full["choices"][0]["logprobs"]["content"]):
        whole = {t["token"]: t["logprob"] for t in f["top_logprobs"]}
        assert g["token"] == f["token"] and g["logprob"] == pytest.approx(f["logprob"], abs=1e-4)
        assert [t["token"] for t in g["top_logprobs"]] == list(dict.fromkeys([g["token"], *named]))
        assert all(t["logprob"] == pytest.approx(whole[t["token"]], abs=1e-4) for t in g["top_logprobs"])
    shown = [[t["token"] for t in c["top_logprobs"]] for c in got]
    chunks = stream(flagged, "/v1/chat/completions", messages=USER, logprob_token_ids=ids, **base)
    assert [[t["token"] for t in c["top_logprobs"]] for ch in chunks for x in ch["choices"] if x.get("logprobs")
            for c in x["logprobs"]["content"]] == shown
    r = post(flagged, "/v1/chat/completions/batch", messages=[USER, USER], logprob_token_ids=ids, **base)
    assert [[[t["token"] for t in c["top_logprobs"]] for c in x["logprobs"]["content"]] for x in r["choices"]] == \
        [shown, shown]
    r = post(flagged, "/v1/completions", prompt="ab", max_tokens=3, temperature=0, ignore_eos=True, logprobs=0,
             logprob_token_ids=ids)
    lp = r["choices"][0]["logprobs"]
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert list(top) == list(dict.fromkeys([tok, *named])) and top[tok] == v
    for body in (dict(logprob_token_ids=ids), dict(logprobs=1, logprob_token_ids=[320]),
                 dict(logprobs=1, logprob_token_ids=list(range(129))), dict(logprobs=1, logprob_token_ids=[])):
        assert refused(server, "/v1/completions", prompt="ab", **body)["param"] == "logprob_token_ids", body
    assert refused(server, "/v1/chat/completions", messages=USER, logprob_token_ids=ids)["param"] == \
        "logprob_token_ids"


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary(server, flagged):
    """As vLLM's: -1 asks every token of the vocabulary (320), refused under --max-logprobs 20, served under 400."""
    for path, body in (("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", {"messages": USER})):
        err = refused(server, path, max_tokens=1, prompt_logprobs=-1, **body)
        assert err["param"] == "prompt_logprobs" and "(320)" in err["message"] and "max_logprobs (20)" in \
            err["message"], err
    r = post(flagged, "/v1/completions", prompt="ab", max_tokens=1, prompt_logprobs=-1)
    assert [len(p) for p in r["choices"][0]["prompt_logprobs"][1:]] == [320]


def test_tokenize_chat_as_vllm(server, flagged):
    """/tokenize of a chat equals the template's text tokenized, continue_final_message included (no end-of-turn
    after the last message); /tokenizer_info names the tokenizer's class as transformers loads it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    convo = USER + [{"role": "assistant", "content": "Sure,"}]
    for gen, cont in ((True, False), (False, False), (False, True)):
        text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=gen, continue_final_message=cont)
        r = post(server, "/tokenize", messages=convo, add_generation_prompt=gen, continue_final_message=cont)
        assert r["tokens"] == tok.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"]), (gen, cont)
    err = refused(server, "/tokenize", messages=convo, continue_final_message=True)  # with add_generation_prompt
    assert err["param"] == "continue_final_message", err
    info = httpx.get(flagged.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__, info


def test_prefix_cache_counters(server):
    """vLLM's prefix_cache_queries / prefix_cache_hits counters (prompt tokens looked up, served by the cache)."""
    def scrape():
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in
                httpx.get(server.url + "/metrics").text.splitlines() if line.startswith("jaxpaged:prefix_cache_")}
    prompt = [int(x) for x in (np.random.default_rng(46).integers(3, 250, 40))]
    before = scrape()
    post(server, "/v1/completions", prompt=prompt, max_tokens=1)
    middle = scrape()
    post(server, "/v1/completions", prompt=prompt, max_tokens=1)
    after = scrape()
    q, h = "jaxpaged:prefix_cache_queries_total", "jaxpaged:prefix_cache_hits_total"
    assert middle[q] - before[q] == 40 and middle[h] == before[h]
    assert after[q] - middle[q] == 40 and after[h] - middle[h] >= 32  # the full blocks of the same prompt


def test_lora_modules_json_as_vllm():
    """--lora-modules takes vLLM's JSON form beside NAME=PATH; a malformed one is an error naming it."""
    from serve.lora import parse_modules
    spec = json.dumps({"name": "sql", "path": "/a/sql", "base_model_name": "base"})
    assert parse_modules(["chat=/a/chat", spec], "base") == [("chat", "/a/chat"), ("sql", "/a/sql")]
    assert parse_modules(['{"name": "x", "path": "/p"}'], "base") == [("x", "/p")]
    for bad, msg in (('{"name": "x"}', "'path' must be a non-empty string"),
                     ('{"name": "x", "path": "/p", "rank": 8}', "unknown keys ['rank']"),
                     ('{"name": "x", "path": "/p", "base_model_name": "other"}', "is not the served model 'base'"),
                     ('{"name": "x", ', "is not valid JSON"), ('["x", "/p"]', "is not NAME=PATH"), ("x", "NAME=PATH")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            parse_modules([bad], "base")
