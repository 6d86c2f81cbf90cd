"""Hostile input against a live server (tiny model), one at a time and all at once among valid requests: a
body nested deeper than MAX_JSON_DEPTH (any depth, either endpoint, any field), `stop` beyond
MAX_STOP_STRINGS strings or MAX_STOP_CHARS characters, `seed` outside int64. Each is a 400 with OpenAI's
error body naming what is wrong; the valid requests sent meanwhile complete, and the engine ends idle with
every block free. Also: the depth count itself, JSON inside strings, and the contract stating the limits."""
import asyncio
import json
import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import Server, assert_error, make_tokenizer, wait_idle

from jaxpaged.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from jaxpaged.testing.tiny_models import make_tiny_model
from serve import tools
from serve.body import MAX_JSON_DEPTH, loads, nesting_depth

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(compile_cache, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hostile_model"))
    make_tiny_model(d, "llama", vocab_size=256)
    make_tokenizer(d)
    srv = Server(d, compile_cache, str(tmp_path_factory.mktemp("logs") / "hostile.log"))
    yield srv
    srv.stop()


def nest(depth: int, inner: str = "1") -> str:
    """`depth` arrays inside one another around `inner`, as JSON text."""
    return "[" * depth + inner + "]" * depth


def body(path: str, raw: dict | None = None, **fields) -> str:
    """A valid request (4 tokens) with `fields`, and the fields of `raw` (values: JSON text) spliced in."""
    base = {"prompt": "the quick brown fox"} if path == CMPL else {"messages": USER}
    text = json.dumps({**base, "max_tokens": 4, "ignore_eos": True, **fields})
    return text[:-1] + "".join(f", {json.dumps(k)}: {v}" for k, v in (raw or {}).items()) + "}"


STOPS_AT_BOUND = [f"{i:02d}" + "z" * (MAX_STOP_CHARS // MAX_STOP_STRINGS - 2) for i in range(MAX_STOP_STRINGS)]
DEEP = "nested_too_deeply"
# name -> (path, body, param, code) of requests that must be refused with a 400
HOSTILE = {
    **{f"prompt_depth_{d + 1}": (CMPL, '{"prompt": ' + nest(d) + "}", None, DEEP)
       for d in (MAX_JSON_DEPTH, 1000, 5000, 30000)},
    "chat_content_depth_5003": (CHAT, '{"messages": [{"role": "user", "content": ' + nest(5000, '"hi"') + "}]}",
                                None, DEEP),
    "unread_field_depth_5001": (CMPL, body(CMPL, {"ignored": nest(5000)}), None, DEEP),
    "unread_field_depth_65": (CHAT, body(CHAT, {"ignored": nest(MAX_JSON_DEPTH)}), None, DEEP),
    "schema_depth_5003": (CMPL, body(CMPL, {"structured_outputs": '{"json": ' + '{"items": ' * 5000 + "{}" +
                                            "}" * 5001}), None, DEEP),
    "never_closed_depth_5001": (CMPL, '{"prompt": ' + "[" * 5000, None, DEEP),
    "array_body_depth_5000": (CHAT, nest(5000), None, DEEP),
    "stop_10000_strings": (CMPL, body(CMPL, stop=["s"] * 10_000), "stop", None),
    "stop_17_strings": (CHAT, body(CHAT, stop=STOPS_AT_BOUND + ["x"]), "stop", None),
    "stop_one_too_long": (CMPL, body(CMPL, stop="z" * (MAX_STOP_CHARS + 1)), "stop", None),
    "stop_total_too_long": (CMPL, body(CMPL, stop=STOPS_AT_BOUND[:-1] + [STOPS_AT_BOUND[-1] + "z"]), "stop",
                            "stop_too_long"),
    **{f"seed_{s}": (path, body(path, seed=s), "seed", None) for path, s in (
        (CMPL, 2 ** 63), (CMPL, -2 ** 63 - 1), (CHAT, 2 ** 70), (CMPL, -2 ** 70))},
}
# name -> (path, body) of requests at the bounds, served
AT_BOUNDS = {
    "depth_64": (CMPL, body(CMPL, {"ignored": nest(MAX_JSON_DEPTH - 1)})),
    "stop_at_bound": (CHAT, body(CHAT, stop=STOPS_AT_BOUND)),
    "seed_min": (CMPL, body(CMPL, seed=-2 ** 63, temperature=1.0)),
    "seed_max": (CHAT, body(CHAT, seed=2 ** 63 - 1, temperature=1.0)),
    # JSON inside a string (an earlier tool call's arguments) is text to the server
    "deep_tool_arguments": (CHAT, json.dumps({"max_tokens": 4, "ignore_eos": True, "messages": [
        *USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": nest(5000)}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]})),
}


def post(server, path, content, timeout=60):
    return httpx.post(server.url + path, content=content, timeout=timeout)


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_alone_is_400(server, name):
    path, content, param, code = HOSTILE[name]
    err = assert_error(post(server, path, content), 400, param, code)
    if code == "nested_too_deeply":
        assert "nested too deeply" in err["message"] and str(MAX_JSON_DEPTH) in err["message"], err
    if param == "stop":  # the message says the limit
        assert str(MAX_STOP_STRINGS) in err["message"] or str(MAX_STOP_CHARS) in err["message"], err


@pytest.mark.parametrize("name", AT_BOUNDS)
def test_at_the_bounds_served(server, name):
    r = post(server, *AT_BOUNDS[name])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_hostile_among_valid_requests(server):
    """Every hostile request of HOSTILE, twice, sent at once with 17 valid ones (some streamed, some at the
    bounds) in a mixed order: each hostile one gets its 400, each valid one completes all its tokens."""
    hostile = list(HOSTILE.values()) * 2
    valid = [(p, body(p, max_tokens=12, stream=i % 4 == 1), 12) for i, p in enumerate([CMPL, CHAT] * 6)]
    valid += [(p, c, 4) for p, c in AT_BOUNDS.values()]
    sent = [(p, c) for p, c, _, _ in hostile] + [(p, c) for p, c, _ in valid]
    order = random.Random(0).sample(range(len(sent)), len(sent))  # hostile and valid mixed

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            async def one(path, content):
                return await ac.post(path, content=content)
            return await asyncio.gather(*[one(*sent[i]) for i in order])
    got = [None] * len(sent)
    for i, r in zip(order, asyncio.run(burst())):
        got[i] = r
    for (_, _, param, code), r in zip(hostile, got):
        assert_error(r, 400, param, code)
    for (_, content, tokens), r in zip(valid, got[len(hostile):]):
        assert r.status_code == 200, r.text
        if json.loads(content).get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == tokens, r.text
    wait_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200


def test_schema_states_the_new_limits(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    for name, path in (("CompletionRequest", CMPL), ("ChatCompletionRequest", CHAT)):
        props = doc["components"]["schemas"][name]["properties"]
        one, many = props["stop"]["anyOf"][:2]
        assert one["maxLength"] == MAX_STOP_CHARS and many["maxItems"] == MAX_STOP_STRINGS
        assert many["items"]["maxLength"] == MAX_STOP_CHARS
        seed = props["seed"]["anyOf"][0]
        assert seed["minimum"] == -2 ** 63 and seed["maximum"] == 2 ** 63 - 1
        rules = {r["code"]: r["rule"] for r in doc["paths"][path]["post"]["x-request-rules"]}
        assert str(MAX_JSON_DEPTH) in rules["nested_too_deeply"] and str(MAX_STOP_CHARS) in rules["stop_too_long"]


# -- the depth count, without a server -----------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ a\u00e9\ud800'),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.text(alphabet='[]{}"\\ k', max_size=3), inner, max_size=3), max_leaves=30)


def depth_of(x) -> int:
    if isinstance(x, (list, dict)):
        return 1 + max(map(depth_of, x.values() if isinstance(x, dict) else x), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(x=JSON, ascii=st.booleans(), indent=st.sampled_from([None, 1]))
def test_nesting_depth_is_the_depth(x, ascii, indent):
    """Brackets and quotes inside strings, escaped or not, do not count."""
    assert nesting_depth(json.dumps(x, ensure_ascii=ascii, indent=indent)) == depth_of(x)


@pytest.mark.parametrize("text,depth", [
    ("[" * 100_000, 100_000), ('["a\\\\"' + "[" * 99, 100), ('"' + '\\"' * 1000 + "[[", 0), ("[1, 2", 1),
    ("[1]]]][[", 1), ('{"a": "b}' + "[" * 99, 1)])
def test_nesting_depth_of_malformed_text(text, depth):
    """The depth the parser reaches before it fails, or more: an escaped backslash ends before a quote;
    an open string runs to the end of the text; closers beyond the openers do not go below the start."""
    assert nesting_depth(text) == depth


def test_deep_json_in_strings_stays_text():
    """JSON nested too deeply inside strings is not parsed: tool-call text of the model's output stays
    content, an earlier call's arguments reach the chat template as text."""
    deep = nest(MAX_JSON_DEPTH + 1)
    with pytest.raises(ValueError, match="nested"):
        loads(deep)
    assert loads(nest(MAX_JSON_DEPTH)) is not None
    calls = '[{"name": "f", "arguments": ' + nest(5000) + "}]"
    assert tools.parse("required", calls, None) == (calls, [])
    assert tools.parse("auto", f"<tool_call>{calls}</tool_call>", None) == (f"<tool_call>{calls}</tool_call>", [])
