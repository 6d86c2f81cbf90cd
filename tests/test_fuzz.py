"""Schemathesis against a live server (tiny model): every request it generates from /openapi.json, valid or
not, gets a schema-conforming answer and never a 5xx; a schema-valid request is refused only for a rule
the schema states (`x-request-rules`); afterwards the engine still serves and every block is free.

Bounded: a fixed seed, MAX_EXAMPLES per operation in the fuzzing phase (plus the examples and coverage
phases), and a BUDGET_S time budget past which the remaining generated cases are not sent.
"""
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from jaxpaged import __version__
from jaxpaged.runner import NUM_BANNED
from models import make_tiny_model
from serve.openapi import openapi_schema
from test_server import Server, make_tokenizer, wait_idle

MAX_EXAMPLES, BUDGET_S, SEED = 30, 120.0, 9
STATS = {"sent": 0, "skipped": 0, "by_status": {}, "start": None}


@pytest.fixture(scope="module")
def fuzz_server(compile_cache, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fuzz_model"))
    make_tiny_model(d, "llama", vocab_size=256)
    make_tokenizer(d)
    srv = Server(d, compile_cache, str(tmp_path_factory.mktemp("logs") / "fuzz.log"),
                 extra=("--max-model-len", "64"))  # short generations keep the run bounded
    yield srv
    srv.stop()


# The contract of the fuzzed server, built here so that pytest can collect one test per operation;
# test_served_schema_is_this_one checks the server publishes exactly this document.
LIMITS = dict(vocab_size=256, max_model_len=64, max_logprobs=20, max_banned_ids=NUM_BANNED, num_eos_ids=1)
DOC = openapi_schema(__version__, limits=LIMITS, model_name="tiny", api_key=False)
schema = schemathesis.openapi.from_dict(DOC)
schema.config.seed = SEED
schema.config.cache.enabled = False  # no crash files left in the working tree
_EXCLUDED = [positive_data_acceptance]  # replaced by the rule-aware check below


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
    if response.status_code == 400 and case.meta is not None and case.meta.generation.mode.is_positive:
        op = case.operation.definition.raw
        codes = {r["code"] for r in op.get("x-request-rules", [])}
        assert response.json()["error"]["code"] in codes, ("schema-valid request refused", response.text,
                                                           repr(case.body)[:500])


def test_after_fuzz_engine_still_serves(fuzz_server):
    print(f"schemathesis: {STATS['sent']} cases sent ({STATS['skipped']} past the budget), by status "
          f"{dict(sorted(STATS['by_status'].items()))}")
    assert STATS["sent"] >= 50  # the fuzzing above really ran
    wait_idle(fuzz_server, timeout=30)
    assert httpx.get(fuzz_server.url + "/health").status_code == 200
    r = httpx.post(fuzz_server.url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
