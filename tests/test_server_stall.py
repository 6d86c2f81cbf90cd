"""A server no client can stall (issue #37), against a live server process over a tiny model with a
byte-level BPE tokenizer: an 8 MB prompt refused from its size while a stream runs (before any tokenizer
call on it), a client that hangs up mid-body (a quiet 499), header and body deadlines, the per-client
connection bound, a non-finite max_tokens, SIGTERM with a stream still open (server_shutdown + [DONE]); output
constraints over --max-grammar-bytes refused before llguidance sees them, and a large legal one compiled while a
stream runs without holding it.

The two stall checks (`stall_failures`) time the stall while it happens: a stream runs and /health is polled
throughout the slow request, the bound is derived from the same stream's gaps and /health's latency measured
just before it, and the stream must be seen alive inside the request's window. Each has a twin with its
protection switched off in the server (SWITCH_PRELUDE) that asserts the same check then fails."""
import argparse
import json
import os
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from test_server import CHAT_TEMPLATE, Server, wait_idle

from jaxpaged.testing.tiny_models import make_tiny_model
from serve.app import add_serve_args
from serve.tools import DEFAULT_MAX_GRAMMAR_BYTES

BIG = 8 * 2 ** 20  # characters of the oversized prompt
# Every call of the tokenizer on a text longer than 100 000 characters leaves a line in the server's log.
PRELUDE = ("import jaxpaged.core.tokenizer as _t\n"
           "_encode = _t.Tokenizer.encode\n"
           "def _counted(self, text, add_special_tokens=True):\n"
           "    if len(text) > 100000: print('BIG_ENCODE', len(text), flush=True)\n"
           "    return _encode(self, text, add_special_tokens)\n"
           "_t.Tokenizer.encode = _counted\n"
           # every grammar llguidance is given (its first call on a constraint) leaves a line too
           "import llguidance as _lg\n"
           "_grammar_from = _lg.grammar_from\n"
           "def _seen(kind, text):\n"
           "    print('GRAMMAR_FROM', kind, len(text), flush=True)\n"
           "    return _grammar_from(kind, text)\n"
           "_lg.grammar_from = _seen\n")
# The protections, switched off while the file named by STALL_SWITCH_OFF exists: the size check before tokenizing
# (every prompt then "fits" it and is tokenized whole) and the grammar compile in a worker thread (then run on the
# event loop itself).
SWITCH_PRELUDE = ("import os as _os, types as _types, asyncio as _asyncio\n"
                  "_off = lambda: _os.path.exists(_os.environ['STALL_SWITCH_OFF'])\n"
                  "import serve.prompt_size as _ps\n"
                  "_unseen = _ps.refused_unseen\n"
                  "_ps.refused_unseen = lambda *a: True if _off() else _unseen(*a)\n"
                  "import serve.tools as _st\n"
                  "async def _to_thread(f, *a, **k):\n"
                  "    return f(*a, **k) if _off() else await _asyncio.to_thread(f, *a, **k)\n"
                  "_st.asyncio = _types.SimpleNamespace(to_thread=_to_thread)\n")
BIG_GRAMMAR_BYTES = 2 ** 21  # the switched server's --max-grammar-bytes: room for a schema that costs seconds
FLAGS = ("--request-header-timeout", "1", "--request-body-timeout", "1", "--max-connections-per-client", "6")


def make_byte_tokenizer(path: str):
    """A byte-level BPE tokenizer: the 256 bytes and no merges (ids 0-255), then <|im_start|> <|im_end|>
    </s> (256-258, </s> the EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("stall_model"))
    make_tiny_model(d, "llama", vocab_size=320)
    make_byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(model_dir, compile_cache, tmp_path_factory):
    srv = Server(model_dir, compile_cache, str(tmp_path_factory.mktemp("logs") / "stall.log"), extra=FLAGS,
                 prelude=PRELUDE, max_body=16 * 2 ** 20)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def switched(model_dir, compile_cache, tmp_path_factory):
    """A server whose two stall protections a test can switch off (yields (server, the switch's path))."""
    off = str(tmp_path_factory.mktemp("switch") / "off")
    os.environ["STALL_SWITCH_OFF"] = off
    try:
        srv = Server(model_dir, compile_cache, str(tmp_path_factory.mktemp("logs") / "switched.log"),
                     extra=(*FLAGS, "--max-grammar-bytes", str(BIG_GRAMMAR_BYTES)), prelude=PRELUDE + SWITCH_PRELUDE,
                     max_body=16 * 2 ** 20)
    finally:
        del os.environ["STALL_SWITCH_OFF"]
    yield srv, off
    srv.stop()


def stream_gaps(url: str, out: dict, started: threading.Event, until: threading.Event | None = None) -> None:
    """Stream a long completion; record the largest gap between its events, their times and whether it ended
    in [DONE]. With `until`, stream one completion after another until it is set."""
    body = {"model": "tiny", "prompt": "the dog", "max_tokens": 200, "stream": True, "ignore_eos": True}
    last, gaps = None, []
    while True:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                if not line:
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                lines.append(line)
                out.setdefault("times", []).append(now)
                started.set()
        out["max_gap"], out["lines"] = max(gaps, default=0.0), lines
        if until is None or until.is_set():
            return


def during_stream(url: str, slow) -> dict:
    """Run `slow()` (a request the server must not stall on) while a long stream runs and /health is polled
    without pause; measure the stream and /health before it (the baseline) and during it."""
    out, started, done = {}, threading.Event(), threading.Event()
    t = threading.Thread(target=stream_gaps, args=(url, out, started, done))
    t.start()
    assert started.wait(60)
    while len(out["times"]) < 12:  # a baseline of 10 gaps between events
        time.sleep(0.01)
    base_health = []
    for _ in range(5):
        t0 = time.monotonic()
        httpx.get(url + "/health", timeout=60)
        base_health.append(time.monotonic() - t0)
    health = []

    def poll():
        while not done.is_set():
            a = time.monotonic()
            httpx.get(url + "/health", timeout=60)
            health.append((a, time.monotonic() - a))

    p = threading.Thread(target=poll)
    t0 = time.monotonic()
    p.start()
    r = slow()
    t1 = time.monotonic()
    time.sleep(0.5)  # more events after the request
    done.set()
    p.join(60)
    t.join(120)
    times = out["times"]
    before = [x for x in times if x < t0]
    gaps = np.diff(before)
    spanning = [x for x in times if x >= before[-1]]  # the last event before the request and all after it
    inside = [b - a for a, b in zip(spanning, spanning[1:]) if a <= t1]  # gaps that overlap the request
    return dict(response=r, window=t1 - t0, baseline_gap=float(gaps.max()), baseline_health=max(base_health),
                gap=max(inside, default=np.inf), events_inside=sum(t0 <= x <= t1 for x in times),
                stream_ended=out["lines"][-1] == "data: [DONE]",
                health=max((d for a, d in health if a <= t1), default=np.inf))


def summary(m: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items() if k != "response")


# A stall is a pause over 20 times the baseline's largest: a compile in a worker thread still slows the stream
# (llguidance and the engine share the GIL and two cores: measured 17 times the baseline's largest gap, the
# stream never stopping), where the loop held by it stops everything for the whole compile (hundreds of times).
STALL_FACTOR = 20
STALL_SHARE = 0.5  # a pause over this share of the slow request's own time is a stall


def stall_failures(m: dict) -> list[str]:
    """What shows the server stalled during the slow request (m from `during_stream`); empty: it did not.
    The stream's largest gap that overlaps the request and the slowest /health answered during it must stay
    under STALL_FACTOR times their baseline, and the stream must have sent events during the request."""
    bound = STALL_FACTOR * max(m["baseline_gap"], m["baseline_health"])
    failures = []
    if m["gap"] >= bound:
        failures.append(f"the stream paused {m['gap']:.3f}s (bound {bound:.3f}s)")
    elif m["gap"] >= STALL_SHARE * m["window"] and m["gap"] >= STALL_FACTOR * m["baseline_gap"]:
        # a busy machine can inflate the baseline's /health time (and so the bound) past a real stall: a pause
        # over half the request's own time, and well over the stream's usual gap, is the loop held by it
        failures.append(f"the stream paused {m['gap']:.3f}s of the request's {m['window']:.3f}s")
    if m["health"] >= bound:
        failures.append(f"/health took {m['health']:.3f}s (bound {bound:.3f}s)")
    if m["events_inside"] == 0:
        failures.append(f"no event of the stream during the request's {m['window']:.3f}s")
    return failures


def oversized(url: str, path: str) -> httpx.Response:
    text = "the quick brown fox " * (BIG // 20)
    body = ({"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]})
    return httpx.post(url + path, json={"model": "tiny", "max_tokens": 4, **body}, timeout=120)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_oversized_prompt_refused_before_tokenizing(switched, path):
    server, _ = switched
    before = server.output()
    m = during_stream(server.url, lambda: oversized(server.url, path))
    r = m["response"]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == ("prompt" if "chat" not in path
                                                                          else "messages"), err
    assert "characters" in err["message"] and "max_model_len is 256" in err["message"]
    assert "BIG_ENCODE" not in server.output()[len(before):]  # the 8 MB text never reached the tokenizer
    assert m["stream_ended"]
    print(f"{path}: {summary(m)}")
    assert stall_failures(m) == []
    wait_idle(server)  # every block given back


def test_oversized_prompt_unguarded_stalls(switched):
    """The twin: with the size check off, the 8 MB text is tokenized whole and the same check fails."""
    server, off = switched
    before = server.output()
    open(off, "w").close()
    try:
        m = during_stream(server.url, lambda: oversized(server.url, "/v1/completions"))
    finally:
        os.remove(off)
    assert m["response"].status_code == 400
    assert "BIG_ENCODE" in server.output()[len(before):]
    print(summary(m))
    assert stall_failures(m), summary(m)
    wait_idle(server)


def test_prompt_within_the_bound_still_served(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "ab" * 100, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a" * 256, "max_tokens": 2},
                   timeout=60)  # 256 tokens: refused after tokenizing, as before
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_non_finite_max_tokens(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, headers={"content-type": "application/json"},
                   content='{"model": "tiny", "prompt": "a", "max_tokens": 1e400}')
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "finite number" in err["message"], err  # pydantic: finite_number


def raw(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return s


def head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_half_body_is_a_quiet_499(server):
    before = server.output()
    s = raw(server)
    s.sendall(head(1000) + b'{"model": "tiny", ')
    time.sleep(0.3)
    s.close()
    deadline = time.monotonic() + 30
    while "client_disconnected" not in server.output()[len(before):] and time.monotonic() < deadline:
        time.sleep(0.1)
    new = server.output()[len(before):]
    lines = [line for line in new.splitlines() if "client_disconnected" in line]
    assert len(lines) == 1 and " 499 " in lines[0], new
    assert "Traceback" not in new and "Exception in ASGI" not in new, new


def read_all(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def test_stalled_body_past_the_deadline(server):
    s = raw(server)
    s.sendall(head(1000) + b'{"model": "tiny", ')
    got = read_all(s)  # answered and closed by the server once the 1 s body deadline passes
    s.close()
    assert got.startswith(b"HTTP/1.1 408"), got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_stalled_header_past_the_deadline(server):
    s = raw(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert read_all(s) == b""  # closed by the server (1 s header deadline), nothing answered
    s.close()
    assert "no complete request header within 1s" in server.output()


def test_connections_per_client_bounded(server):
    held = [raw(server) for _ in range(6)]
    extra = raw(server)
    assert read_all(extra) == b""  # the 7th is closed at once (the 6 are held until their header deadline)
    extra.close()
    for s in held:
        s.close()
    assert "connection refused: 6 connections open" in server.output()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # once they are gone


@pytest.mark.slow
def test_sigterm_ends_open_streams_with_an_error_event(model_dir, compile_cache, tmp_path):
    srv = Server(model_dir, compile_cache, str(tmp_path / "term.log"), grace=0.0)
    out, started = {}, threading.Event()
    t = threading.Thread(target=stream_gaps, args=(srv.url, out, started))
    t.start()
    assert started.wait(60)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0, srv.output()
    t.join(60)
    lines = out["lines"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_shutdown", lines[-3:]
    log = srv.output()
    assert "Traceback" not in log and "CancelledError" not in log, log
    srv.stop()


# -- output constraints: bounded before llguidance, compiled off the event loop and the engine thread ----------
def int_schema(n: int) -> dict:
    """An object of n bounded integer properties: llguidance's costliest shape per byte that we measured
    (~61 KB at n = 1000; validate 0.1 s + matcher 0.3 s over SmolLM2's vocabulary on the 2-core CPU)."""
    return {"type": "object", "properties": {f"f{i}": {"type": "integer", "minimum": i, "maximum": 10 * i + 1000}
                                             for i in range(n)}}


def grammar_calls(server) -> int:
    return server.output().count("GRAMMAR_FROM")


BIG_SCHEMA = int_schema(1100)  # over the default 64 KiB
_MSG = [{"role": "user", "content": "hi"}]
_TOOLS = [{"type": "function", "function": {"name": f"t{i}", "parameters": int_schema(110)}} for i in range(10)]
OVER = {
    "structured_outputs.json": ("/v1/completions", {"prompt": "a", "structured_outputs": {"json": BIG_SCHEMA}}),
    "structured_outputs.regex": ("/v1/completions", {"prompt": "a", "structured_outputs": {
        "regex": "|".join(f"word{i}" for i in range(8000))}}),
    "structured_outputs.choice": ("/v1/completions", {"prompt": "a", "structured_outputs": {
        "choice": [f"option {i}" for i in range(7000)]}}),
    "response_format.json_schema.schema": ("/v1/chat/completions", {"messages": _MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}}),
    "tools.function.parameters": ("/v1/chat/completions", {"messages": _MSG, "tools": _TOOLS,
                                                           "tool_choice": "required"}),
}


@pytest.mark.parametrize("param", list(OVER))
def test_constraint_over_the_limit_refused_before_llguidance(server, param):
    path, body = OVER[param]
    before = grammar_calls(server)
    r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_too_large" and err["param"] == param, err
    assert f"the limit is {DEFAULT_MAX_GRAMMAR_BYTES} bytes (--max-grammar-bytes)" in err["message"], err
    assert grammar_calls(server) == before  # refused from its size: llguidance never saw it


def test_constraint_within_the_limit_still_compiled(server):
    before = grammar_calls(server)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "a", "max_tokens": 4, "structured_outputs": {"regex": "[ab]{1,3}x"}})
    assert r.status_code == 200, r.text
    assert grammar_calls(server) == before + 1  # compiled once: SamplingParams and add_request reuse it
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "a", "max_tokens": 4, "structured_outputs": {"regex": "a(b"}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text


# ~0.37 MB, under llguidance's lexer limit: held on the loop, a pause of 4-5 s on the quiet 2-core kind, ~100 times
# the stream's gaps, so a busy machine's larger baseline still leaves it well past STALL_FACTOR
COSTLY = int_schema(6000)


def costly_constraint(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": _MSG, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": COSTLY}}})


def test_large_legal_schema_does_not_stall_a_stream(switched):
    server, _ = switched
    assert DEFAULT_MAX_GRAMMAR_BYTES < len(json.dumps(COSTLY)) <= BIG_GRAMMAR_BYTES
    before = grammar_calls(server)
    m = during_stream(server.url, lambda: costly_constraint(server.url))
    assert m["response"].status_code == 200, m["response"].text
    assert grammar_calls(server) == before + 1
    assert m["stream_ended"]
    print(f"large schema: {summary(m)}")
    assert stall_failures(m) == []  # compiled in a worker thread, not on the loop nor the engine thread
    wait_idle(server)


def test_large_schema_compiled_on_the_loop_stalls(switched):
    """The twin: compiled on the event loop, the same schema fails the same check."""
    server, off = switched
    open(off, "w").close()
    try:
        m = during_stream(server.url, lambda: costly_constraint(server.url))
    finally:
        os.remove(off)
    assert m["response"].status_code == 200, m["response"].text
    print(summary(m))
    assert stall_failures(m), summary(m)
    wait_idle(server)


def test_max_grammar_bytes_flag():
    parser = add_serve_args(argparse.ArgumentParser())
    assert parser.parse_args([]).max_grammar_bytes == DEFAULT_MAX_GRAMMAR_BYTES == 65536
    assert parser.parse_args(["--max-grammar-bytes", "1000"]).max_grammar_bytes == 1000
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-grammar-bytes", "0"])


def test_openapi_states_the_grammar_bound(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations"):
        rules = {r["code"]: r["rule"] for r in doc["paths"][path]["post"]["x-request-rules"]}
        assert f"at most {DEFAULT_MAX_GRAMMAR_BYTES} bytes (--max-grammar-bytes)" in rules["grammar_too_large"]
    props = doc["components"]["schemas"]["StructuredOutputs"]["properties"]
    assert props["regex"]["maxLength"] == props["grammar"]["maxLength"] == DEFAULT_MAX_GRAMMAR_BYTES
