"""/v1/completions (plain, streamed, beam search): prompts as text, token ids or vLLM's prompt_embeds, echo
(max_tokens 0: the prompt alone), logprobs of the prompt and the output; its pieces of the one generation path
(serve/generation.py)."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from serve import beam, request_rules, tools
from serve import outputs as fmt
from serve.errors import APIError
from serve.generation import Plan, generate
from serve.job import Job, sse
from serve.prompts import completion_prompts, embeds_prompts, truncation
from serve.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from serve.routes import num_logprobs, sampling_params, shown_logprobs, stream_usage, token_text


def check_embeds(req: CompletionRequest, embeds: list, prompt_logprobs: int | None) -> None:
    """A prompt or prompt_embeds (as vLLM's); embeddings have no tokens to echo or give logprobs of."""
    if req.prompt is None and not embeds:
        raise APIError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt",
                       code="empty_prompt")
    if embeds and (req.echo or prompt_logprobs is not None):  # vLLM's words, then why
        said = "Echo is unsupported with prompt embeds" if req.echo else \
            "prompt_logprobs is not compatible with prompt embeds"
        raise APIError(400, f"{said}: prompts given as embeddings have no token ids (prompt_embeds)",
                       param="prompt_embeds", code="invalid_combination")


def _texts(req: CompletionRequest) -> list:
    """The prompts of `prompt`: one string or token-id list, or a list of them."""
    p = req.prompt
    return [] if p is None else [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


@dataclass(kw_only=True)
class CompletionPlan(Plan):
    k: int | None = None  # top logprobs per token (None: none)
    shown: int | None = None  # the logprobs each generated token shows (fmt.ALL: logprob_token_ids)
    pl: int | None = None  # the response's prompt_logprobs
    echo_only: bool = False  # max_tokens 0: the prompt (and its logprobs), nothing generated
    text: fmt.TokenText | None = None


class Completions:
    """The pieces of /v1/completions."""
    kind, model, prefix = request_rules.COMPLETION, CompletionRequest, "cmpl"

    async def plan(self, st, req: CompletionRequest) -> CompletionPlan:
        if req.use_beam_search:
            beam.refuse(req, st.max_logprobs)
            keep, side = truncation(req, st.engine.max_model_len, req.max_tokens)
            prompts = await completion_prompts(st.engine, _texts(req), keep, side)
            return CompletionPlan(prompts=prompts, params=None, max_tokens=req.max_tokens)
        echo_only = req.max_tokens == 0  # run 1 token, drop it
        structured, _, rename = await tools.constraint(req, st.engine, st.config.max_grammar_bytes)
        k = num_logprobs(st, "logprobs", req.logprobs)
        shown = shown_logprobs(req, k)  # of the generated tokens (echo: the prompt's show the top k)
        pl = num_logprobs(st, "prompt_logprobs", req.prompt_logprobs)
        engine_pl = max((x for x in (pl, k if req.echo else None) if x is not None), default=None)
        params = sampling_params(req, 1 if echo_only else req.max_tokens, k, rename, structured, engine_pl)
        prompts, e = _texts(req), req.prompt_embeds
        embeds = [] if e is None else [e] if isinstance(e, str) else list(e)
        check_embeds(req, embeds, pl)
        fmt.check_routes_request(req, len(embeds) + len(prompts))
        keep, side = truncation(req, st.engine.max_model_len, params.max_tokens)
        # as vLLM's: the embeddings' prompts (and choices) first
        prompts = await embeds_prompts(st.engine, embeds, keep, side) + await completion_prompts(
            st.engine, prompts, keep, side)
        return CompletionPlan(prompts=prompts, params=params, rename=rename, k=k, shown=shown, pl=pl,
                              echo_only=echo_only, text=token_text(st, req))

    def _choice(self, req, plan: CompletionPlan, i, c, text_piece, ids, lps, offset, prompt=None, out=None):
        text, k = plan.text, plan.k
        lp = fmt.completion_logprobs(text, ids, lps, plan.shown, offset) if k is not None else None
        if lp is not None and prompt is not None:  # echo: the prompt's tokens first
            lp = fmt.echo_logprobs(text, prompt, k, lp)
        ids_out = bool(req.return_token_ids)
        return CompletionChoice(index=i * req.n + c.index, text=text_piece, logprobs=lp, finish_reason=c.finish_reason,
                                routed_experts=fmt.routes(c.routed_experts),
                                prompt_logprobs=fmt.prompt_logprobs(text, out, plan.pl) if out is not None else None,
                                prompt_token_ids=list(out.prompt_token_ids) if ids_out and out is not None else None,
                                token_ids=list(ids) if ids_out else None)

    def response(self, st, req, plan: CompletionPlan, job: Job) -> CompletionResponse:
        if plan.echo_only:
            job.lasts = [fmt.without_generated(o) for o in job.lasts]
        choices = []
        for i, out in enumerate(job.lasts):
            prefix = plan.text.prompt_text(out) if req.echo else ""
            choices += [self._choice(req, plan, i, c, prefix + c.text, c.token_ids, c.logprobs, len(prefix),
                                     out if req.echo else None, out) for c in out.outputs]
        return CompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=choices,
                                  usage=job.usage(),
                                  prompt_routed_experts=fmt.routes(job.lasts[0].prompt_routed_experts))

    async def events(self, st, req, plan: CompletionPlan, job: Job):
        text, n, ids_out = plan.text, req.n, bool(req.return_token_ids)
        last_usage, every_usage = stream_usage(st, req)
        deltas = [[fmt.Delta() for _ in range(n)] for _ in plan.prompts]
        echoed = [[not req.echo] * n for _ in plan.prompts]
        started = [[False] * n for _ in plan.prompts]  # return_token_ids: the prompt's ids go in the first chunk
        async for i, out in job.outputs():
            if plan.echo_only:
                out = job.lasts[i] = fmt.without_generated(out)
            for c in out.outputs:
                d = deltas[i][c.index]
                got = d.advance(c)
                if got is None:
                    continue
                piece, ids, lps, _ = got
                base = len(text.prompt_text(out)) if req.echo else 0  # offsets count the echo
                offset, prompt = base + d.text_len - len(piece), None
                if not echoed[i][c.index]:
                    echoed[i][c.index], prompt = True, out
                    piece = text.prompt_text(out) + piece
                ch = self._choice(req, plan, i, c, piece, ids, lps, offset, prompt)
                if ids_out and not started[i][c.index]:
                    started[i][c.index], ch.prompt_token_ids = True, list(out.prompt_token_ids)
                yield sse(CompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=[ch],
                                             usage=job.usage() if every_usage else None))
        if last_usage:
            yield sse(CompletionResponse(id=job.id, created=job.created, model=st.model_name, choices=[],
                                         usage=job.usage()))

    def beam_answers(self, st, req, plan: CompletionPlan, found, head: dict):
        tok, choices, completion = st.engine.tokenizer, [], 0
        ids = beam.prompt_ids(plan.prompts)
        for i, seqs in enumerate(found.best()):
            prefix = "" if not req.echo else (plan.prompts[i].get("prompt") if isinstance(plan.prompts[i], dict)
                                              else None) or (tok.decode(ids[i], skip_special_tokens=False)
                                                             if tok is not None else "")
            for j, s in enumerate(seqs):
                out = found.generated(i, s)
                completion += len(out)
                text = tok.decode(out, skip_special_tokens=req.skip_special_tokens) if tok is not None else ""
                choices.append(CompletionChoice(index=i * req.n + j, text=prefix + text, finish_reason=s.finish_reason,
                                                prompt_token_ids=list(ids[i]) if req.return_token_ids else None,
                                                token_ids=out if req.return_token_ids else None))
        usage = beam.usage(ids, completion)
        return (CompletionResponse(**head, choices=choices, usage=usage),
                [CompletionResponse(**head, choices=[c]) for c in choices],
                CompletionResponse(**head, choices=[], usage=usage))


COMPLETIONS = Completions()


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    return await generate(request, COMPLETIONS)
