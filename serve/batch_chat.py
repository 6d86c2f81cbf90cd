"""vLLM's POST /v1/chat/completions/batch: a chat request whose `messages` is a list of conversations, answered
by one chat completion with one choice per conversation (`index` = the conversation's), usage summed.

As vLLM's: not streamed, no tools, `n` 1 (each refused by name otherwise); every other chat field applies to
each conversation (sampling, logprobs, response_format / structured_outputs, echo, add_generation_prompt,
continue_final_message, return_token_ids). Each conversation is one engine request, all queued together or
none; prompt_logprobs and return_routed_experts, answered once per response, are refused here.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from serve import outputs as fmt
from serve import request_rules
from serve.chat import chat_choice, chat_params, chat_prompt, echo_text
from serve.generation import Plan, generate
from serve.job import Job
from serve.prompts import truncate, truncation
from serve.protocol import ChatCompletionRequest, ChatCompletionResponse, Message
from serve.routes import token_text

_NOT_HERE = "not supported by batch chat completions (as vLLM's)"


class BatchChatCompletionRequest(ChatCompletionRequest):
    messages: Annotated[list[Annotated[list[Message], Field(min_length=1)]], Field(min_length=1)] = Field(
        description="the conversations, each a list of messages; one choice per conversation")
    stream: Literal[False] = Field(False, description=f"only false: streaming is {_NOT_HERE}")
    stream_options: None = Field(None, description="only null (no streaming)")
    n: Literal[1] = Field(1, description="only 1: one choice per conversation")
    tools: None = Field(None, description=f"only null: tools are {_NOT_HERE}")
    tool_choice: Literal["none"] | None = Field(None, description="none or null (no tools)")
    prompt_logprobs: None = Field(None, description=f"only null: {_NOT_HERE}")
    return_routed_experts: Literal[False] = Field(False, description=f"only false: {_NOT_HERE}")


def _prompts(engine, req: BatchChatCompletionRequest, keep: int | None, side: str | None) -> list[list[int]]:
    """Each conversation's token ids (call in a worker thread: it renders and tokenizes)."""
    return [truncate(chat_prompt(engine, conv, None, req.add_generation_prompt, False, req.continue_final_message,
                                 keep is None, req.chat_template_kwargs), keep, side) for conv in req.messages]


@dataclass(kw_only=True)
class BatchChatPlan(Plan):
    shown: int | None = None  # the logprobs each token shows or None
    mode: str | None = None  # the tool mode (serve/tools.py): constrained output only here
    text: fmt.TokenText | None = None


class BatchChat:
    """The pieces of /v1/chat/completions/batch (never streamed, no beam search)."""
    kind, model, prefix = request_rules.BATCH_CHAT, BatchChatCompletionRequest, "chatcmpl"

    async def plan(self, st, req: BatchChatCompletionRequest) -> BatchChatPlan:
        params, k, _, rename, mode, max_tokens = await chat_params(st, req, len(req.messages))
        keep, side = truncation(req, st.engine.max_model_len, max_tokens)
        prompts = await asyncio.to_thread(_prompts, st.engine, req, keep, side)
        return BatchChatPlan(prompts=prompts, params=params, rename=rename, shown=k, mode=mode,
                             text=token_text(st, req))

    def response(self, st, req, plan: BatchChatPlan, job: Job) -> ChatCompletionResponse:
        choices = []
        for i, (conv, out) in enumerate(zip(req.messages, job.lasts)):
            role = "assistant" if req.add_generation_prompt else conv[-1].role
            c = out.outputs[0]
            lp = fmt.chat_logprobs(plan.text, c.token_ids, c.logprobs, plan.shown) if plan.shown is not None else None
            choices.append(chat_choice(st, c, i, plan.mode, None, role, echo_text(req, conv, role), lp,
                                       bool(req.return_token_ids)))
        return ChatCompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=choices,
                                      usage=job.usage())


BATCH_CHAT_ROUTE = BatchChat()


async def batch_chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions/batch."""
    return await generate(request, BATCH_CHAT_ROUTE)
