"""Schemathesis against a live server (tiny model): every request it generates from /openapi.json, valid or
not, gets a schema-conforming answer and never a 5xx; a schema-valid request is refused only for a rule
the schema states (`x-request-rules`); a schema-invalid one is accepted only when pydantic's lax mode (vLLM's)
coerces it into a schema-valid one ("5" for 5, 0 for false); afterwards the engine still serves and every
block is free.

Bounded: a fixed seed, MAX_EXAMPLES per operation in the fuzzing phase (plus the examples and coverage
phases), and a BUDGET_S time budget past which the remaining generated cases are not sent.
"""
import re
import time

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import ValidationError
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance
from test_server import Server, make_tokenizer, wait_idle

from jaxpaged import __version__
from jaxpaged.step.runner import NUM_BANNED
from jaxpaged.testing.tiny_models import make_tiny_model
from serve.batch_chat import BatchChatCompletionRequest
from serve.openapi import openapi_schema
from serve.protocol import ChatCompletionRequest, CompletionRequest

MAX_EXAMPLES, BUDGET_S, SEED = 30, 120.0, 9
STATS = {"sent": 0, "skipped": 0, "by_status": {}, "start": None, "constrained_ok": 0}


@pytest.fixture(scope="module")
def fuzz_server(compile_cache, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fuzz_model"))
    make_tiny_model(d, "llama", vocab_size=256)
    make_tokenizer(d)
    _byte_level_decoder(d)  # so llguidance can read it: constrained requests run too
    srv = Server(d, compile_cache, str(tmp_path_factory.mktemp("logs") / "fuzz.log"),
                 extra=("--max-model-len", "64", "--runner", "pooling"))  # short generations keep the run bounded;
    # --runner pooling: the embedding routes too
    yield srv
    srv.stop()


def _byte_level_decoder(d):
    """The word-level test tokenizer has no decoder, which llguidance refuses; its words are plain ASCII,
    which a byte-level decoder leaves as they are."""
    from tokenizers import Tokenizer, decoders
    tok = Tokenizer.from_file(f"{d}/tokenizer.json")
    tok.decoder = decoders.ByteLevel()
    tok.save(f"{d}/tokenizer.json")


# The contract of the fuzzed server, built here so that pytest can collect one test per operation;
# test_served_schema_is_this_one checks the server publishes exactly this document.
LIMITS = dict(vocab_size=256, max_model_len=64, max_logprobs=20, max_banned_ids=NUM_BANNED, num_eos_ids=1)
DOC = openapi_schema(__version__, limits=LIMITS, model_name="tiny", api_key=False, pooling=True)
schema = schemathesis.openapi.from_dict(DOC)
schema.config.seed = SEED
schema.config.cache.enabled = False  # no crash files left in the working tree
_EXCLUDED = [positive_data_acceptance, negative_data_rejection]  # replaced by the rule- and lax-aware checks below
_REQUESTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
             "/v1/chat/completions/batch": BatchChatCompletionRequest}


def not_lax_coercible(path: str, body) -> str | None:
    """Why a schema-invalid body the server accepted is not one that pydantic's lax mode turns into a
    schema-valid one (None when it is: the schema states the canonical types, the server takes vLLM's)."""
    model = _REQUESTS[path]
    try:
        coerced = model.model_validate(body).model_dump(mode="json", by_alias=True, exclude_unset=True)
    except ValidationError as e:
        return f"lax validation refuses it too: {e}"
    check = jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{model.__name__}",
                                         "components": DOC["components"]})
    errors = [str(e) for e in check.iter_errors(coerced)]
    return f"coerced, it still violates the schema: {errors[:3]}" if errors else None


def test_served_schema_is_this_one(fuzz_server):
    assert httpx.get(fuzz_server.url + "/openapi.json").json() == DOC


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_fuzz(case, fuzz_server):
    if STATS["start"] is None:
        STATS["start"] = time.monotonic()
    if time.monotonic() - STATS["start"] > BUDGET_S:
        STATS["skipped"] += 1
        return
    response = case.call_and_validate(base_url=fuzz_server.url, excluded_checks=_EXCLUDED, timeout=60)
    STATS["sent"] += 1
    STATS["by_status"][response.status_code] = STATS["by_status"].get(response.status_code, 0) + 1
    assert response.status_code < 500, (response.text, repr(case.body)[:500])
    if response.status_code == 200 and case.operation.path in _REQUESTS and case.meta is not None and \
            case.meta.generation.mode.is_negative:  # (a GET's negative cases are headers, which it ignores)
        why = not_lax_coercible(case.operation.path, case.body)
        assert why is None, (why, repr(case.body)[:500])
    body = case.body if isinstance(case.body, dict) else {}
    fmt = body.get("response_format")  # any value on a route without the field (e.g. /v1/score: ignored)
    if response.status_code == 200 and (body.get("structured_outputs") or body.get("tool_choice") not in (
            None, "none", "auto") or (fmt.get("type") if isinstance(fmt, dict) else None) in ("json_object",
                                                                                               "json_schema")):
        STATS["constrained_ok"] += 1
    if response.status_code == 400 and case.meta is not None and case.meta.generation.mode.is_positive:
        op = case.operation.definition.raw
        codes = {r["code"] for r in op.get("x-request-rules", [])}
        assert response.json()["error"]["code"] in codes, ("schema-valid request refused", response.text,
                                                           repr(case.body)[:500])


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"structured_outputs": {"choice": ["the", "fox"]}}),
    ("/v1/completions", {"structured_outputs": {"regex": "(the|fox)+"}}),
    ("/v1/completions", {"structured_outputs": {"grammar": 'start: "the" ("fox" | "dog")*'}}),
    ("/v1/completions", {"structured_outputs": {"regex": ""}}),  # complete at once
    ("/v1/completions", {"structured_outputs": {"json": {}}, "n": 2}),  # no "{" in this vocabulary
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "stream": True}),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "stream": True}),
    ("/v1/chat/completions", {"tools": [TOOL]}),
    ("/v1/completions", {"structured_outputs": {"choice": ["the", "fox"]}, "min_tokens": 3}),  # forced past the end
])
def test_constrained_requests_on_a_tiny_vocabulary(fuzz_server, path, extra):
    """Grammars this vocabulary can or cannot satisfy, complete at once, forced past their end: each is
    served (200) and ends; a satisfiable one is obeyed."""
    body = {"max_tokens": 8, "temperature": 1.0, "seed": 1, **extra}
    body.update({"prompt": "the quick brown fox"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "the quick brown fox"}]})
    r = httpx.post(fuzz_server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    if "choice" in extra.get("structured_outputs", {}) and "min_tokens" not in extra:
        assert r.json()["choices"][0]["text"] in ("the", "fox")
    if "regex" in extra.get("structured_outputs", {}) and extra["structured_outputs"]["regex"]:
        text = r.json()["choices"][0]["text"]
        assert re.fullmatch("(the|fox)+", text), text


def test_after_fuzz_engine_still_serves(fuzz_server):
    print(f"schemathesis: {STATS['sent']} cases sent ({STATS['skipped']} past the budget), by status "
          f"{dict(sorted(STATS['by_status'].items()))}; {STATS['constrained_ok']} constrained requests served")
    assert STATS["sent"] >= 50  # the fuzzing above really ran
    wait_idle(fuzz_server, timeout=30)
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    r = httpx.post(fuzz_server.url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
