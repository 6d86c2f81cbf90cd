"""The RL controls over HTTP (vLLM's names): `POST /pause?mode=abort|wait|keep`, `POST /resume`,
`GET /is_paused`. Behind the API key like /v1/*; the engine's pause semantics are jaxpaged/controls/pause.py."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve.errors import APIError
from serve.routes import check_auth


async def pause(request: Request) -> Response:
    """Pause generation; answers once paused (mode "wait": once the running requests are done)."""
    check_auth(request)
    mode = request.query_params.get("mode", "abort")
    try:
        await request.app.state.server.engine.pause_generation(mode)
    except ValueError as e:
        raise APIError(400, str(e), param="mode") from None
    return JSONResponse({"is_paused": True, "mode": mode})


async def resume(request: Request) -> Response:
    check_auth(request)
    await request.app.state.server.engine.resume_generation()
    return JSONResponse({"is_paused": False})


async def is_paused(request: Request) -> Response:
    check_auth(request)
    return JSONResponse({"is_paused": request.app.state.server.engine.is_paused()})
