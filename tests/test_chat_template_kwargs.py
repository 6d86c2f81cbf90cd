"""vLLM's `chat_template_kwargs` (chat, batch chat, /tokenize of a chat): further variables reach the chat
template's render (e.g. Qwen3's `enable_thinking`), over the special tokens'; a value that is not an object,
or keys the request's own fields set (messages, tools, add_generation_prompt), are refused naming the field.
No engine: the prompt is rendered and tokenized by the server's function over a word-level tokenizer."""
from types import SimpleNamespace

import pydantic
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from jaxpaged.core.tokenizer import Tokenizer
from serve import request_rules
from serve.chat import chat_prompt
from serve.errors import APIError
from serve.protocol import ChatCompletionRequest
from serve.protocol_tokenize import TokenizeChatRequest

WORDS = ["[UNK]", "think", "nothink", "<s>", "<B>", "user"]
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ m['role'] }} {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}nothink{% else %}think{% endif %}")


@pytest.fixture(scope="module")
def engine():
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer(backend, {"chat_template": TEMPLATE, "bos_token": "<s>"}, "words")
    return SimpleNamespace(tokenizer=tok, max_model_len=64)


def render(engine, **body) -> list[str]:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    request_rules.check(req, request_rules.CHAT)
    ids = chat_prompt(engine, req.messages, check_size=False, template_kwargs=req.chat_template_kwargs)
    return [WORDS[i] for i in ids]


def test_a_template_variable_reaches_the_render(engine):
    assert render(engine) == ["<s>", "user", "think"]
    assert render(engine, chat_template_kwargs={"enable_thinking": False}) == ["<s>", "user", "nothink"]
    over = {"enable_thinking": True, "bos_token": "<B>"}  # over the special tokens' too, as transformers'
    assert render(engine, chat_template_kwargs=over) == ["<B>", "user", "think"]


@pytest.mark.parametrize("kind,model", [(request_rules.CHAT, ChatCompletionRequest),
                                        (request_rules.TOKENIZE, TokenizeChatRequest)])
def test_the_requests_own_variables_are_refused(kind, model):
    req = model(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"tools": [], "messages": []})
    with pytest.raises(APIError) as e:
        request_rules.check(req, kind)
    assert e.value.param == "chat_template_kwargs" and "messages, tools" in str(e.value)


@pytest.mark.parametrize("value", ["enable_thinking", ["enable_thinking"], 1])
def test_not_an_object_is_refused(value):
    with pytest.raises(pydantic.ValidationError, match="chat_template_kwargs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=value)
