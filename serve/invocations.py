"""vLLM's POST /invocations (SageMaker's): routed by its body to /v1/chat/completions or /v1/completions."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from serve.body import read_json
from serve.chat import chat_completions
from serve.completions import completions
from serve.errors import APIError
from serve.routes import check_auth


async def invocations(request: Request) -> Response:
    """A body with `messages` is a chat completion, one with `prompt` (or `prompt_embeds`) a completion (as
    vLLM's); else a 400."""
    st = request.app.state.server
    check_auth(request)
    request.state.body = data = await read_json(request, st.config.max_body_bytes, st.config.request_body_timeout)
    if "messages" in data:
        return await chat_completions(request)
    if "prompt" in data or "prompt_embeds" in data:
        return await completions(request)
    raise APIError(400, "an /invocations body needs messages (a chat completion) or prompt (a completion)",
                   param="messages")
