"""vLLM's server load: `GET /load` answers `{"server_load": N}`, the generation requests being handled now.

With `--enable-server-load-tracking`, each request of a generation route (`counted`: completions, chat,
batch chat, /invocations) counts from its start until its response is over: a plain answer sent, a stream
ended (finished, cut by shutdown, or its client gone), or an error raised. Without the flag nothing is
counted and /load answers 0, as vLLM's (the route is always served).
"""
from __future__ import annotations

import functools

from starlette.requests import Request
from starlette.responses import JSONResponse, Response


class Load:
    """The count of generation requests in flight (touched on the event loop only)."""

    def __init__(self, tracking: bool = False):
        self.tracking, self.value = tracking, 0


class _Counted:
    """A response that releases its request's count once it has been sent (or its sending failed)."""

    def __init__(self, response: Response, load: Load):
        self.response, self.load = response, load

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.load.value -= 1


def counted(handler):
    """A generation route's handler, counted in the server's load while tracking is on."""
    @functools.wraps(handler)
    async def route(request: Request):
        load: Load = request.app.state.server.load
        if not load.tracking:
            return await handler(request)
        load.value += 1
        try:
            response = await handler(request)
        except BaseException:
            load.value -= 1
            raise
        return _Counted(response, load)
    return route


async def server_load(request: Request) -> Response:
    return JSONResponse({"server_load": request.app.state.server.load.value})
