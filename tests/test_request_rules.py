"""The request rules of serve/request_rules.py, one table: each rule is stated in the OpenAPI document (as an
if/then of its kinds' request schemas or in their operations' `x-request-rules`), each rule the server checks
is enforced (a 400 with OpenAI's error body naming its field), and a rule taken out of the table is gone from
both. No server or model: the checks run on validated request models, the document is built from limits."""
import json
import os

import pytest

from serve import request_rules
from serve.batch_chat import BatchChatCompletionRequest
from serve.errors import APIError
from serve.openapi import openapi_schema
from serve.protocol import ChatCompletionRequest, CompletionRequest
from serve.protocol_embed import EmbeddingRequest, RerankRequest, ScoreRequest
from serve.request_rules import BATCH_CHAT, CHAT, COMPLETION, EMBED, RERANK, RESPONSES, RULES, SCORE, TOKENIZE
from serve.responses_protocol import ResponsesRequest

LIMITS = dict(vocab_size=256, max_model_len=64, max_logprobs=20, max_banned_ids=16, num_eos_ids=1)
FACTS = {"limits": LIMITS, "max_grammar_bytes": 1000}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}
KINDS = {  # kind -> (request model, a valid body, the operation, the request schema)
    COMPLETION: (CompletionRequest, {"prompt": "hi"}, "/v1/completions", "CompletionRequest"),
    CHAT: (ChatCompletionRequest, _MESSAGES, "/v1/chat/completions", "ChatCompletionRequest"),
    BATCH_CHAT: (BatchChatCompletionRequest, {"messages": [_MESSAGES["messages"]]}, "/v1/chat/completions/batch",
                 "BatchChatCompletionRequest"),
    TOKENIZE: (None, None, "/tokenize", None),
    RESPONSES: (ResponsesRequest, {"input": "hi"}, "/v1/responses", "ResponsesRequest"),
    EMBED: (EmbeddingRequest, {"input": "hi"}, "/v1/embeddings", None),
    SCORE: (ScoreRequest, {"text_1": "hi", "text_2": ["a", "b"]}, "/score", None),
    RERANK: (RerankRequest, {"query": "hi", "documents": ["a"]}, "/rerank", None),
}
CHECKED = [r for r in RULES if r.broken is not None]


def _doc() -> dict:
    return openapi_schema("0", limits=LIMITS, model_name="m", api_key=False, max_grammar_bytes=1000, pooling=True)


def _stated(doc: dict, rule, kind: str) -> bool:
    """Whether the document states `rule` for requests of `kind`."""
    _, _, path, schema = KINDS[kind]
    if rule.schema is not None:
        all_of = doc["components"]["schemas"][schema]["allOf"]
        return all(s in all_of for s in rule.schema(FACTS))
    entry = {"code": rule.code, "rule": rule.statement(FACTS)}
    return entry in doc["paths"][path]["post"]["x-request-rules"]


def _broken_request(rule):
    model, body, _, _ = KINDS[rule.kinds[0]]
    return model.model_validate({**body, **rule.example})


def _label(rule) -> str:
    return f"{rule.field}:{rule.code}:{rule.statement(FACTS)[:30]}"


@pytest.mark.parametrize("rule", RULES, ids=_label)
def test_every_rule_is_stated_for_each_of_its_kinds(rule):
    doc = _doc()
    for kind in rule.kinds:
        assert _stated(doc, rule, kind), kind
    if rule.schema is None and set(rule.kinds) & {COMPLETION, CHAT}:  # /invocations takes both kinds
        assert {"code": rule.code, "rule": rule.statement(FACTS)} in doc["paths"]["/invocations"]["post"][
            "x-request-rules"]
    assert rule.broken is not None or rule.where is not None, "a rule nobody enforces"
    if rule.where is not None:
        assert os.path.isfile(os.path.join(ROOT, rule.where)), rule.where


@pytest.mark.parametrize("rule", CHECKED, ids=_label)
def test_every_checked_rule_is_enforced(rule):
    model, body, _, _ = KINDS[rule.kinds[0]]
    request_rules.check(model.model_validate(body), rule.kinds[0])  # the valid body passes
    with pytest.raises(APIError) as e:
        request_rules.check(_broken_request(rule), rule.kinds[0])
    error = json.loads(e.value.response().body)["error"]
    assert e.value.status == 400 and error["param"] == rule.field and error["code"] == rule.code
    assert error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("rule", CHECKED, ids=_label)
def test_a_rule_taken_out_of_the_table_is_neither_stated_nor_enforced(monkeypatch, rule):
    monkeypatch.setattr(request_rules, "RULES", [r for r in RULES if r is not rule])
    assert not any(_stated(_doc(), rule, kind) for kind in rule.kinds)
    request_rules.check(_broken_request(rule), rule.kinds[0])  # no 400 from it any more
