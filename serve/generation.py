"""The one path of every generation route: parse -> plan (params, prompts) -> job -> render.

/v1/completions (serve/completions.py), /v1/chat/completions (serve/chat.py), /v1/chat/completions/batch
(serve/batch_chat.py) and beam search (serve/beam.py) differ only in their pieces: a `GenerationRoute` says
which request model and rules it takes, makes the plan (its checks, the engine's parameters, the prompts as
token ids) and renders the finished job (a response), its outputs as they come (stream events) or the beams
of a search. `generate` runs them, in that order, for all of them:

    async def completions(request): return await generate(request, COMPLETIONS)
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.core.sampling_params import SamplingParams
from serve import beam
from serve.job import Job, JobStream, run_to_end
from serve.routes import parse


@dataclass(kw_only=True)
class Plan:
    """What a route made of a validated request: the engine's work, and (in a route's subclass) what
    rendering it needs."""
    prompts: list  # the engine prompts: token ids, or dicts (the text or embeddings beside the ids)
    params: SamplingParams | None  # None: a beam search (serve/beam.py)
    rename: dict[str, str] = field(default_factory=dict)  # engine parameter names -> the request's
    max_tokens: int | None = None  # a beam search's (None: up to max_model_len)
    names: tuple[str, str] = ("prompt", "max_tokens")  # the fields a beam search's length errors name


class GenerationRoute(Protocol):
    """A generation route's own pieces."""
    kind: str  # its request rules' kind (serve/request_rules.py)
    model: type  # its request model (serve/protocol.py)
    prefix: str  # its responses' id prefix

    async def plan(self, st, req) -> Plan:
        """The request's own checks, engine parameters and prompts (params None: a beam search)."""

    def response(self, st, req, plan: Plan, job: Job) -> BaseModel:
        """The response of a finished job (not streamed)."""

    def events(self, st, req, plan: Plan, job: Job) -> AsyncIterator[str]:
        """The server-sent events of the job's outputs as they come (routes whose requests may stream)."""

    def beam_answers(self, st, req, plan: Plan, found, head: dict) -> tuple[BaseModel, list[BaseModel], BaseModel]:
        """A finished beam search (routes that take use_beam_search) as (the response, its chunks, the usage
        chunk); `head`: the id, created and model of each."""


async def generate(request: Request, route: GenerationRoute) -> Response:
    """Serve one generation request on `route`: parse, plan, run (a job, or a beam search), render."""
    st = request.app.state.server
    req = await parse(request, route.model, route.kind)
    plan = await route.plan(st, req)
    if plan.params is None:
        return await beam.answer(request, req, plan, route)
    job = Job(request, route.prefix, plan.rename)
    await job.start(plan.prompts, plan.params, stream=req.stream)
    if req.stream:
        return JobStream(job, route.events(st, req, plan, job))
    if not await run_to_end(job):
        return Response(status_code=499)
    body = route.response(st, req, plan, job)
    job.close(200)
    return JSONResponse(body.model_dump())
