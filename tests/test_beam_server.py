"""`use_beam_search: true` on /v1/completions against a live server (issue #36): n is the beam width, the
choices are the n best beams (best first) of each prompt, as the brute-force search of test_beam_search
finds them over HF's logits; streamed as whole choices; refusals name the field; chat too; every block
free afterwards. One server for the module."""
import json
import time

import httpx
import pytest
from test_beam_search import brute_force
from test_server import Server, make_tokenizer, metrics, wait_idle

from jaxpaged.testing.tiny_models import make_tiny_model

EOS = 2  # make_tokenizer's </s>, the tiny model's EOS


@pytest.fixture(scope="module")
def served(compile_cache, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("beam_model"))
    make_tiny_model(d, "llama", vocab_size=256, seed=3)
    make_tokenizer(d)
    srv = Server(d, compile_cache, str(tmp_path_factory.mktemp("logs") / "beam.log"),
                 extra=("--block-size", "8"))
    yield srv, d
    srv.stop()


def post(srv, **body):
    return httpx.post(srv.url + "/v1/completions", json={"model": "tiny", **body}, timeout=120)


def generated(tokens, prompt):
    out = tokens[len(prompt):]
    return out[:-1] if out and out[-1] == EOS else out  # a finishing EOS is not in token_ids


def test_choices_are_the_best_beams(served):
    srv, path = served
    prompts = [[10, 11, 12, 13, 14], [20 + i for i in range(19)]]
    r = post(srv, prompt=prompts, n=3, use_beam_search=True, temperature=0, max_tokens=6, return_token_ids=True,
             length_penalty=0.5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, p in enumerate(prompts):
        want = brute_force(path, p, 3, 6, EOS, length_penalty=0.5)
        got = body["choices"][3 * i: 3 * i + 3]
        assert [c["token_ids"] for c in got] == [generated(w[0], p) for w in want]
        assert [c["finish_reason"] for c in got] == ["stop" if w[0][-1] == EOS else "length" for w in want]
        assert all(c["prompt_token_ids"] == p for c in got)
    assert body["usage"]["prompt_tokens"] == 24
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
    wait_idle(srv)


def test_text_echo_and_stream(served):
    srv, _ = served
    one = post(srv, prompt="the quick brown fox", n=2, use_beam_search=True, temperature=0, max_tokens=4,
               echo=True)
    assert one.status_code == 200, one.text
    choices = one.json()["choices"]
    assert len(choices) == 2 and all(c["text"].startswith("the quick brown fox") for c in choices)
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=120, json=dict(
            model="tiny", prompt="the quick brown fox", n=2, use_beam_search=True, temperature=0, max_tokens=4,
            echo=True, stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0] for c in chunks[:2]] == choices
    assert chunks[2]["choices"] == [] and chunks[2]["usage"] == one.json()["usage"]
    wait_idle(srv)


@pytest.mark.parametrize("body,param", [
    (dict(logprobs=2), "logprobs"),
    (dict(n=11), "n"),  # 2 * 11 > --max-logprobs 20
    (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(structured_outputs={"choice": ["the"]}), "structured_outputs"),
])
def test_refusals_name_the_field(served, body, param):
    srv, _ = served
    r = post(srv, **{"prompt": "the", "use_beam_search": True, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "invalid_combination"


def test_chat(served):
    """Chat: the conversation through the chat template, then the same search; streamed as whole choices."""
    srv, path = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the quick brown fox"}], "n": 2,
            "use_beam_search": True, "temperature": 0, "max_completion_tokens": 4, "return_token_ids": True}
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = out["prompt_token_ids"]
    want = brute_force(path, prompt, 2, 4, EOS)
    assert [c["token_ids"] for c in out["choices"]] == [generated(w[0], prompt) for w in want]
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 3
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [c["delta"]["content"] for c in chunks] == [c["message"]["content"] for c in out["choices"]]
    bad = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        **body, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    wait_idle(srv)


def test_disconnect_aborts_the_search(served):
    """A client that goes away mid-search: the iteration's requests are aborted and no further iteration
    runs (the engine computes far fewer tokens than the whole search's least), every block comes back."""
    srv, _ = served
    tokens = lambda: metrics(srv)["jaxpaged:iteration_tokens_total_sum"]  # noqa: E731
    before = tokens()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.1), json={
            "model": "tiny", "prompt": [5, 6, 7], "n": 10, "use_beam_search": True, "max_tokens": 250,
            "ignore_eos": True})
    time.sleep(2)  # the whole search takes about half a second here: it would have ended by now
    wait_idle(srv, timeout=30)
    assert tokens() - before < 10 * 250  # each of the 250 iterations computes >= 1 token for each of 10 beams
    r = post(srv, prompt="the", n=2, use_beam_search=True, temperature=0, max_tokens=2)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_recorded_in_the_metrics(served):
    srv, _ = served
    name = 'jaxpaged:request_success_total{finished_reason="length",model_name="tiny"}'
    before = metrics(srv).get(name, 0)
    r = post(srv, prompt=[[5, 6], [7, 8]], n=2, use_beam_search=True, temperature=0, max_tokens=3, ignore_eos=True)
    assert r.status_code == 200
    assert metrics(srv)[name] == before + 2  # one request per prompt
