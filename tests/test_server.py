"""The OpenAI-compatible server, end to end: a real uvicorn process on 127.0.0.1 over a tiny random model
with a small word-level tokenizer, driven by the real `openai` client (and httpx for raw HTTP)."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from jaxpaged.testing.tiny_models import make_tiny_model
from jaxpaged.testing.xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"
MAX_NUM_SEQS, MAX_WAITING, MAX_BODY = 8, 32, 64 * 1024
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def make_tokenizer(path: str, vocab_size: int = 256):
    """A word-level tokenizer of exactly vocab_size tokens (ids 0-4 special, </s> = 2 = the model's EOS)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "user",
             "assistant", "system", "hi", "a", "b", "c", "d"]
    cons, vows = "bdfgklmnprstvz", "aeiou"
    words += [x + v + y for x in cons for v in vows for y in cons if x + v + y not in words]
    vocab = {w: i for i, w in enumerate((SPECIALS + words)[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 additional_special_tokens=SPECIALS[3:])
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(path)
    return hf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`run_server` in a subprocess (so SIGTERM and exit codes are real); logs go to a file."""

    def __init__(self, model_dir, cache_dir, log_path, *, grace=30.0, extra=(), prelude="", max_body=MAX_BODY,
                 fast_compile=True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = ("import argparse, sys, jax; jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
                + prelude +
                "from serve.app import add_serve_args, run_server\n"
                "args = add_serve_args(argparse.ArgumentParser()).parse_args(sys.argv[1:])\n"
                f"run_server(args, max_body_bytes={max_body}, "
                f"engine_kwargs=dict(compilation_cache_dir={cache_dir!r}, show_progress=False))\n")
        argv = ["--model", model_dir, "--served-model-name", "tiny", "--port", str(self.port), "--dtype", "float32",
                "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "64", "--max-model-len", "256",
                "--max-waiting", str(MAX_WAITING), "--shutdown-timeout", str(grace), *extra]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=ROOT, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=subprocess_env(fast_compile=fast_compile))
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("server_model"))
    make_tiny_model(d, "llama", vocab_size=256)
    make_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(model_dir, compile_cache, tmp_path_factory):
    srv = Server(model_dir, compile_cache, str(tmp_path_factory.mktemp("logs") / "server.log"),
                 extra=("--api-key", API_KEY))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def metrics(server) -> dict:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("jaxpaged:"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0] + ("{" + name.split("{", 1)[1] if "finished_reason" in name else "")] = float(value)
    return out


def wait_idle(server, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["jaxpaged:num_requests_running"] == 0 and m["jaxpaged:num_requests_waiting"] == 0 \
                and m["jaxpaged:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"engine not idle: {m}"
        time.sleep(0.05)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 5)  # 45 tokens: full blocks to cache


# -- the happy paths ---------------------------------------------------------------------------
def test_models_health_openapi(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(spec["paths"])
    assert "CompletionRequest" in spec["components"]["schemas"]


def test_completion_usage_and_echo(client, tokenizer):
    prompt = "the quick brown fox"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **GREEDY)
    (c,) = r.choices
    assert c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    e = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, echo=True, **GREEDY)
    assert e.choices[0].text == prompt + c.text
    ids = tokenizer.encode(prompt)  # token ids give the same greedy text
    t = client.completions.create(model="tiny", prompt=ids, max_tokens=12, **GREEDY)
    assert t.choices[0].text == c.text


def test_streamed_equals_plain(client):
    kw = dict(model="tiny", prompt="hello world", max_tokens=40, **GREEDY)
    plain = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40

    msgs = [{"role": "system", "content": "a b"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "the dog"}]
    ckw = dict(model="tiny", messages=msgs, max_completion_tokens=30, **GREEDY)
    chat = client.chat.completions.create(**ckw)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 30
    parts = list(client.chat.completions.create(stream=True, **ckw))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"


def test_chat_usage_counts_template(client, tokenizer):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "the lazy dog"}]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, **GREEDY)
    want = tokenizer.apply_chat_template([{"role": "user", "content": "the lazy dog"}], add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens == 5


def test_n_and_multiple_prompts(client):
    r = client.completions.create(model="tiny", prompt=["the quick", "lazy dog"], n=3, max_tokens=6,
                                  temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 36
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=5, stream=True,
                                          extra_body={"ignore_eos": True})
    text = {0: "", 1: ""}
    for ch in chat:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
    assert all(text.values())


def test_stop_strings_and_seed(client):
    kw = dict(model="tiny", prompt=LONG, max_tokens=24, **GREEDY)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    streamed = client.completions.create(stop=stop, stream=True, **kw)
    assert "".join(ch.choices[0].text for ch in streamed) == cut.text

    sample = dict(model="tiny", prompt=LONG, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **sample).choices[0].text
    b = client.completions.create(seed=1234, **sample).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **sample).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt="the quick", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens).replace(" ", "") == r.choices[0].text.replace(" ", "")
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(v)  # greedy: the top one
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2, **GREEDY)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


# -- errors ------------------------------------------------------------------------------------
def raw(server, body, path="/v1/completions", key=API_KEY, timeout=30):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("body,param", [
    ("{not json", None),
    ("[1, 2]", None),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "logprobs": 99}, "logprobs"),
    ({"prompt": "a", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": {"x": 1}}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_requests_400(server, body, param):
    assert_error(raw(server, body), 400, param)


def test_bad_chat_400(server):
    assert_error(raw(server, {"messages": []}, "/v1/chat/completions"), 400, "messages")
    assert_error(raw(server, {"messages": [{"role": "", "content": "x"}]}, "/v1/chat/completions"), 400, "messages")
    assert_error(raw(server, {"messages": [{"role": 5, "content": "x"}]}, "/v1/chat/completions"), 400, "messages")
    # another role's message goes to the chat template as it is (as vLLM's)
    assert raw(server, {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 1},
               "/v1/chat/completions").status_code == 200
    assert_error(raw(server, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                     "/v1/chat/completions"), 400, "top_logprobs")


def test_context_length_400(server, client):
    err = assert_error(raw(server, {"prompt": "the quick", "max_tokens": 300}), 400, "max_tokens",
                       "context_length_exceeded")
    assert "max_tokens" in err["message"] and "max_model_len" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=" ".join(["dog"] * 300), max_tokens=4)
    assert e.value.status_code == 400 and "max_model_len" in e.value.message


@pytest.mark.parametrize("body,param,code", [
    ('{"prompt": "a", "temperature": NaN}', None, None),
    ('{"prompt": "a", "top_p": Infinity}', None, None),
    ('{"prompt": "a", "temperature": 1e400}', "temperature", None),
    ({"prompt": "a", "temperature": 1e39}, "temperature", None),          # beyond float32
    ({"prompt": [1, "x"]}, "prompt", None),
    ({"prompt": [1, 2.5]}, "prompt", None),                               # lax, as vLLM: 2.0 would be 2
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens", None),
    ({"prompt": "a", "max_tokens": "two"}, "max_tokens", None),
    ({"prompt": "a", "n": [1]}, "n", None),
    ({"prompt": "\ud800abc"}, "prompt", None),
    ({"prompt": "a", "stop": ["ok", "\udc00"]}, "stop", None),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": [[]]}, "prompt", None),
    ({"prompt": "a", "top_k": 2 ** 31}, "top_k", None),                  # once an int32 overflow in the step
    ({"prompt": "a", "top_k": 257}, "top_k", None),                      # vocab_size 256
    ({"prompt": "a", "min_tokens": 1, "stop_token_ids": [2 ** 31]}, "stop_token_ids", None),
    ({"prompt": "a", "stop_token_ids": [256]}, "stop_token_ids", None),
    ({"prompt": "a", "min_tokens": 1, "max_tokens": 4, "stop_token_ids": list(range(3, 19))}, "stop_token_ids",
     None),                                                              # + 1 EOS id > 16 banned ids
    ({"prompt": "a", "best_of": 3}, "best_of", "invalid_combination"),
    ({"prompt": "a", "min_tokens": 3, "max_tokens": 2}, "min_tokens", "invalid_combination"),
    ({"prompt": "a", "suffix": "x"}, "suffix", None),
    # this server has no --enable-prompt-embeds (tests/test_prompt_embeds_server.py: one that has)
    ({"prompt": "a", "prompt_embeds": "AAAA"}, "prompt_embeds", "invalid_prompt_embeds"),
    ({"max_tokens": 2}, "prompt", "empty_prompt"),                       # neither prompt nor prompt_embeds
    ({"prompt": "a", "use_beam_search": True, "logprobs": 1}, "logprobs", "invalid_combination"),
    ({"prompt": "a", "use_beam_search": True, "n": 11}, "n", "invalid_combination"),  # 2n > max_logprobs 20
    ({"prompt": "a", "use_beam_search": True, "max_tokens": 0, "echo": True}, "max_tokens", "invalid_combination"),
    ({"prompt": "the quick", "use_beam_search": True, "max_tokens": 256}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias", None),       # OpenAI's range: [-100, 100]
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", None),
    ({"prompt": "a", "logit_bias": {"256": 1}}, "logit_bias", "invalid_token_id"),  # vocab_size 256
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", None),               # only with echo
    ({"prompt": "a", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "invalid_combination"),
    ({"prompt": "the quick", "max_tokens": 256}, "max_tokens", None),
])
def test_validation_400s(server, body, param, code):
    assert_error(raw(server, body), 400, param, code)


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user"}], "messages"),
    ([{"role": "user", "content": None}], "messages"),
    ([{"role": "assistant"}], "messages"),
    ([{"role": "user", "content": "hi \ud800"}], "messages"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], "messages"),
    ([{"role": "tool", "content": "x"}], "messages"),
])
def test_chat_messages_need_their_content(server, messages, param):
    assert_error(raw(server, {"messages": messages, "max_tokens": 2}, "/v1/chat/completions"), 400, param)
    for extra, p, code in (({"tools": [{"type": "function"}]}, "tools", None),
                           # this tokenizer (word level, no decoder) is one llguidance cannot read
                           ({"response_format": {"type": "json_object"}}, "response_format",
                            "structured_outputs_unsupported")):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        assert_error(raw(server, body, "/v1/chat/completions"), 400, p, code)


def test_several_prompts_all_or_nothing(server):
    """One bad prompt of several: a 400 naming it, and nothing of the others ran or is counted."""
    before = metrics(server)
    for prompts, code in ((["the quick brown fox", "\ud800abc"], None), (["the quick brown fox", "  "], "empty_prompt"),
                          ([[5, 6, 7], [5] * 300], "context_length_exceeded")):
        err = assert_error(raw(server, {"prompt": prompts, "max_tokens": 200, "ignore_eos": True}), 400,
                           "prompt", code)
        assert "1" in err["message"] or "Unicode" in err["message"]
    after = wait_idle(server)
    for name in ("jaxpaged:prompt_tokens_total", "jaxpaged:generation_tokens_total"):
        assert after[name] == before[name], name
    assert httpx.get(server.url + "/health").status_code == 200


def test_int64_seed_reduced_mod_2_32(client):
    """Seeds are int64 (beyond: tests/test_hostile.py); equal residues mod 2**32, equal samples."""
    sample = dict(model="tiny", prompt="the quick", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    texts = {client.completions.create(seed=s, **sample).choices[0].text
             for s in (-1, 2 ** 32 - 1, 2 ** 63 - 1, -2 ** 63 + 2 ** 32 - 1)}
    assert len(texts) == 1


def test_schema_states_the_limits_and_security(server):
    from serve.openapi import openapi_schema
    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    req = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert req["top_k"]["maximum"] == 256 and req["max_tokens"]["maximum"] == 255
    assert req["prompt"]["anyOf"][0] == {"minLength": 1, "type": "string"}
    assert req["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 255
    assert {r["code"] for r in doc["paths"]["/v1/completions"]["post"]["x-request-rules"]} >= {
        "context_length_exceeded", "empty_prompt", "invalid_combination"}
    open_doc = openapi_schema("0", limits=dict(vocab_size=10, max_model_len=8, max_logprobs=5, max_banned_ids=16,
                                               num_eos_ids=1), model_name="m", api_key=False)
    assert "securitySchemes" not in open_doc["components"]
    assert all("security" not in op for path in open_doc["paths"].values() for op in path.values())


def test_auth_model_route_size_errors(server):
    assert_error(raw(server, {"prompt": "a"}, key=None), 401, code="invalid_api_key")
    assert_error(raw(server, {"prompt": "a"}, key="wrong"), 401, code="invalid_api_key")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert_error(raw(server, {"prompt": "a", "model": "gpt-4"}), 404, "model", "model_not_found")
    assert_error(httpx.get(server.url + "/v2/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)
    assert_error(raw(server, {"prompt": "dog " * (MAX_BODY // 2)}), 413)
    assert httpx.get(server.url + "/health").status_code == 200


def test_queue_full_503_while_the_rest_complete(server):
    async def burst():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i):
            try:
                r = await ac.completions.create(model="tiny", prompt=f"the dog {i}", max_tokens=48,
                                                extra_body={"ignore_eos": True})
                return r.usage.completion_tokens
            except openai.APIStatusError as e:
                return e
        return await asyncio.gather(*[one(i) for i in range(3 * (MAX_NUM_SEQS + MAX_WAITING))])
    results = asyncio.run(burst())
    ok = [r for r in results if r == 48]
    rejected = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert len(ok) + len(rejected) == len(results), results
    assert len(ok) >= MAX_NUM_SEQS + MAX_WAITING // 2 and rejected
    for e in rejected:
        assert e.status_code == 503 and e.response.headers["retry-after"]
        assert e.response.json()["error"]["code"] == "queue_full"
    wait_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200


# -- disconnects, metrics, idle -----------------------------------------------------------------
def test_disconnects_abort_and_free_blocks(server):
    before = metrics(server).get('jaxpaged:request_success_total{finished_reason="abort",model_name="tiny"}', 0)

    async def clients():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i):
            if i % 2:
                s = await ac.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {i}"}],
                                                     max_tokens=200, stream=True, extra_body={"ignore_eos": True})
            else:
                s = await ac.completions.create(model="tiny", prompt=f"the fox {i}", max_tokens=200, stream=True,
                                                extra_body={"ignore_eos": True})
            k = 0
            async for _ in s:
                k += 1
                if k == 2:
                    break
            await s.close()
        await asyncio.gather(*[one(i) for i in range(20)])
    asyncio.run(clients())
    # a non-streamed request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        raw(server, {"prompt": "the lazy dog", "max_tokens": 240, "ignore_eos": True}, timeout=0.05)
    m = wait_idle(server)
    after = m['jaxpaged:request_success_total{finished_reason="abort",model_name="tiny"}']
    assert after - before == 21
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_names(server):
    m = metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "request_time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert f"jaxpaged:{name}" in m, name
    assert m["jaxpaged:generation_tokens_total"] > 0 and m["jaxpaged:time_to_first_token_seconds_count"] > 0
    assert 0 < m["jaxpaged:prefix_cache_hit_rate"] <= 1  # the repeated prompts above hit the cache
    text = httpx.get(server.url + "/metrics").text
    reasons = {r: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxpaged:num_requests_waiting_by_reason{")
               for r in ("capacity", "deferred") if f'reason="{r}"' in line}
    assert set(reasons) == {"capacity", "deferred"} and reasons["deferred"] == 0
    # vLLM 0.32's bucket families: TTFT up to 2560 s, e2e on the request-latency buckets (up to 7680 s)
    assert 'jaxpaged:time_to_first_token_seconds_bucket{le="2560.0",model_name="tiny"}' in text
    assert 'jaxpaged:e2e_request_latency_seconds_bucket{le="7680.0",model_name="tiny"}' in text


def test_idle_server_uses_no_cpu(server):
    wait_idle(server)

    def cpu():
        with open(f"/proc/{server.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    c0, t0 = cpu(), time.monotonic()
    time.sleep(2.0)
    assert (cpu() - c0) / (time.monotonic() - t0) < 0.05


def test_one_log_line_per_request(server, client):
    r = client.completions.create(model="tiny", prompt="a b c", max_tokens=3, **GREEDY)
    time.sleep(0.2)
    lines = [line for line in server.output().splitlines() if r.id in line]
    assert len(lines) == 1 and "prompt_tokens=3 output_tokens=3" in lines[0] and "ttft=" in lines[0]


# -- SIGTERM -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_drains_then_exits_0(model_dir, compile_cache, tmp_path):
    srv = Server(model_dir, compile_cache, str(tmp_path / "term.log"), grace=2.0)
    results, started = [], threading.Semaphore(0)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def run(i):
        try:
            s = c.completions.create(model="tiny", prompt=f"the dog {i}", max_tokens=200, stream=True,
                                     extra_body={"ignore_eos": True})
            chunks = []
            for ch in s:
                if not chunks:
                    started.release()
                chunks.append(ch)
            results.append(chunks[-1].choices[0].finish_reason)
        except (openai.APIError, httpx.HTTPError) as e:
            started.release()
            results.append(type(e).__name__)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    assert started.acquire(timeout=60)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0, srv.output()
    assert time.monotonic() - t0 < 15
    for t in threads:
        t.join(30)
    assert len(results) == 40 and "length" in results, results
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")
    srv.stop()


def test_bench_serving_smoke(server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.bench.serving", "--base-url", server.url,
                           "--api-key", API_KEY, "--num-prompts", "12", "--input-len", "10", "--output-len", "8",
                           "--request-rate", "inf", "--max-concurrency", "4", "--result-json", str(out),
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "P99 TTFT (ms)" in proc.stdout
    s = json.loads(out.read_text())
    assert s["completed"] == 12 and s["failed"] == 0 and s["total_output_tokens"] == 96
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert s[key] > 0, key


# -- prompt logprobs (echo) and logit_bias: what lm-evaluation-harness's local-completions sends ------------
def _hf_logprobs(model_dir, ids):
    import torch
    from oracle import hf_model
    with torch.no_grad():
        return torch.log_softmax(hf_model(model_dir)(torch.tensor([ids])).logits[0].double(), -1).numpy()


LM_EVAL_PROMPTS = [[5, 17, 30, 41, 99, 120, 7, 64, 200, 33], [9, 8, 7, 6, 5, 250]]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_as_lm_eval_sends(server, model_dir, max_tokens):
    """lm-eval's loglikelihood payload (token-id prompts, echo, logprobs 1, max_tokens 1, temperature 0, seed)
    and its parsing: token_logprobs[ctxlen:-1] summed, greedy when each equals the top of top_logprobs.
    The prompt's logprobs equal transformers' log_softmax; max_tokens 0 returns the prompt only."""
    body = {"model": "tiny", "prompt": LM_EVAL_PROMPTS, "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = raw(server, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == max_tokens * len(LM_EVAL_PROMPTS)
    for choice, ids in zip(sorted(out["choices"], key=lambda c: c["index"]), LM_EVAL_PROMPTS):
        lp = choice["logprobs"]
        n = len(ids) + max_tokens
        lengths = {len(lp[f]) for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert lengths == {n}
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = _hf_logprobs(model_dir, ids)
        for j in range(1, len(ids)):
            assert abs(lp["token_logprobs"][j] - want[j - 1, ids[j]]) < 1e-3
            assert abs(max(lp["top_logprobs"][j].values()) - want[j - 1].max()) < 1e-3
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        ctxlen = 3  # lm-eval: the continuation's logprob and whether it is greedy
        got = sum(lp["token_logprobs"][ctxlen:len(ids)])
        assert abs(got - sum(want[j - 1, ids[j]] for j in range(ctxlen, len(ids)))) < 1e-3
        if max_tokens == 0:
            assert choice["finish_reason"] == "length"
    streamed = {**body, "prompt": LM_EVAL_PROMPTS[0], "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=streamed,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as resp:
        chunks = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    first = chunks[0]["choices"][0]["logprobs"]
    plain = sorted(out["choices"], key=lambda c: c["index"])[0]["logprobs"]
    assert first["token_logprobs"][:len(LM_EVAL_PROMPTS[0])] == plain["token_logprobs"][:len(LM_EVAL_PROMPTS[0])]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]) == len(plain["tokens"])
    wait_idle(server)


def test_lm_eval_local_completions_loglikelihood(server, model_dir, monkeypatch):
    """lm-evaluation-harness itself, unmodified: LocalCompletionsAPI.loglikelihood against the server."""
    api = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    lm = api.LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", tokenizer=model_dir,
                                 tokenizer_backend="huggingface", batch_size=2, max_length=256, max_retries=1)
    pairs = [("the quick brown", " fox jumps"), ("hello world", " the lazy dog")]
    res = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                           disable_tqdm=True)
    for (ctx, cont), (ll, greedy) in zip(pairs, res):
        c, x = lm.tok_encode(ctx), lm.tok_encode(cont)
        want = _hf_logprobs(model_dir, c + x)
        assert abs(ll - sum(want[len(c) - 1 + j, t] for j, t in enumerate(x))) < 1e-3
        assert greedy == all(want[len(c) - 1 + j].argmax() == t for j, t in enumerate(x))


def test_logit_bias_on_completions_and_chat(client, model_dir, tokenizer):
    """OpenAI's logit_bias (string token ids -> bias): +100 on a token makes greedy pick it every time; -100 on
    the plain greedy choice moves it to the next best, as transformers' logits say."""
    ids = [5, 17, 30]
    want = _hf_logprobs(model_dir, ids)[-1]
    first, second = np.argsort(-want)[:2]

    def completion(bias):
        text = client.completions.create(model="tiny", prompt=ids, max_tokens=3, logit_bias=bias, **GREEDY)
        return tokenizer.encode(text.choices[0].text, add_special_tokens=False)
    assert completion(None)[0] == first
    assert completion({"77": 100}) == [77, 77, 77]
    assert completion({str(first): -100})[0] == second
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, logit_bias={"77": 100}, **GREEDY)
    assert tokenizer.encode(chat.choices[0].message.content, add_special_tokens=False) == [77, 77]
