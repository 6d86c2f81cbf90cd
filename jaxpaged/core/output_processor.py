"""The output processor: stop checks, detokenizing and the outputs of each user request.

A user request is a `Group` of its n samples (one `Request` each). After every step the engine hands
the processor the requests that got tokens; it checks each token they got since its last look for a
stop (EOS and stop ids, stop strings, a complete grammar, max_tokens, max_model_len), builds the outputs
of the groups that advanced (streamed ones) or finished, and returns the stopped samples as `Finish`es,
which the engine has the scheduler apply: the processor reads requests, it writes neither their tokens nor
their status. A step that gave a request several tokens (accepted speculative proposals) is checked
token by token, as if each came in its own step: the tokens past the first stop are the scheduler's to drop.

Host code: numpy at most (the final outputs' hidden states and routed experts are host arrays).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.core.iteration_stats import IterationTokens
from jaxpaged.core.outputs import CompletionOutput, RequestOutput
from jaxpaged.core.request import ListPrefix, Request, RequestStatus
from jaxpaged.core.step_result import Finish
from jaxpaged.core.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class Group:
    """One user request: its n samples and their detokenizers."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    detoks: list[IncrementalDetokenizer]
    arrival: float
    stream: bool = True                # an output every step it advances (else only the final one)
    finished_time: float | None = None
    # seconds between one step's tokens and the next's, over its samples (vLLM's inter-token latencies)
    inter_token_latencies: list[float] = field(default_factory=list)
    # per sample (by index): its tokens the stop checks saw (the prompt at first); when its first and its
    # latest tokens reached this processor
    num_checked: list[int] = field(init=False)
    first_token_times: list[float | None] = field(init=False)
    last_token_times: list[float | None] = field(init=False)

    def __post_init__(self):
        self.num_checked = [len(r.token_ids) for r in self.samples]
        self.first_token_times = [None] * len(self.samples)
        self.last_token_times = [None] * len(self.samples)
        # detokenize every step (streamed text, stop strings), or only when the final output is built
        self.text_each_step = self.stream or bool(self.samples[0].params.stop)


class OutputProcessor:
    """The unfinished groups, by request id, and what happens to them after each step. It finishes no
    request itself: each call that decides finishes returns them (`Finish`), for the scheduler to apply
    (`Scheduler.finish_all`) before the next step is scheduled; the outputs it builds already show them."""

    def __init__(self, structured, max_model_len: int):
        self.structured, self.max_model_len = structured, max_model_len
        self.groups: dict[str, Group] = {}
        self._ready: list[RequestOutput] = []  # outputs built since the last `update` returned
        self.iteration_tokens = IterationTokens()  # tokens of each step with outputs (vLLM's iteration_tokens)

    def add(self, group: Group) -> None:
        self.groups[group.request_id] = group

    def abort(self, request_id: str) -> list[Finish]:
        """Forget the group; its unfinished samples finish "abort" (none for an unknown id)."""
        group = self.groups.pop(request_id, None)
        return list(_finishing(group, "abort").values()) if group is not None else []

    def abort_all(self) -> tuple[list[RequestOutput], list[Finish]]:
        """Abort every unfinished group: their final outputs, and the finishes."""
        outputs, finishes, now = [], [], time.monotonic()
        for group in [self.groups.pop(rid) for rid in list(self.groups)]:
            ending = _finishing(group, "abort")
            outputs.append(self._finish(group, now, stops=ending))
            finishes += ending.values()
        return outputs, finishes

    def fail(self, group_ids, message: str) -> list[Finish]:
        """A failed step's groups: every sample finishes with "error" (returned); their final outputs, which
        carry `message`, come with the next `update`."""
        finishes, now = [], time.monotonic()
        for group in [self.groups.pop(g) for g in group_ids]:
            ending = _finishing(group, "error")
            self._ready.append(self._finish(group, now, message, ending))
            finishes += ending.values()
        return finishes

    # -- after a step ---------------------------------------------------------------------------------
    def update(self, got: list[Request]) -> tuple[list[RequestOutput], list[Finish]]:
        """`process(got)`; returns every output built since the last update (a failed step's, those of a
        step the async executor read back early), in the order they were built, and the stops to apply."""
        stops = self.process(got)
        outputs, self._ready = self._ready, []
        return outputs, stops

    def process(self, got: list[Request]) -> list[Finish]:
        """Stop checks of the requests that got tokens, then the outputs of the groups that changed (as they
        are once the stops are applied). Returns the stops, which the caller has the scheduler apply
        (`Scheduler.finish_all`) before the next step is scheduled: this processor writes no request's
        tokens and finishes none.

        Only requests that stream or have stop strings are detokenized here; the others when their final
        output is built."""
        now, groups, outputs = time.monotonic(), self.groups, self._ready
        touched: dict[str, Group] = {}  # groups of n > 1 samples: one output for all that advanced
        stops: dict[Request, Finish] = {}
        step_tokens = 0  # as vLLM counts a step: its new output tokens, and the prompts that got their first
        for req in got:
            group = groups[req.group_id]
            i = req.index
            if group.first_token_times[i] is None:
                group.first_token_times[i] = now
                step_tokens += req.num_prompt_tokens - req.num_cached_tokens  # the prompt computed
            else:
                group.inter_token_latencies.append(now - group.last_token_times[i])
            group.last_token_times[i] = now
            length = len(req.token_ids)
            if length - group.num_checked[req.index] > 1:
                reason, length = self._check_each(req, group)
            else:
                stop_string = group.text_each_step and group.detoks[req.index].catch_up(req.token_ids)
                reason = self._check_stop(req, stop_string, length)
            step_tokens += length - group.num_checked[req.index]  # the tokens kept (up to a stop)
            group.num_checked[req.index] = length
            if reason:
                stops[req] = Finish(req, reason, length)
            if len(group.samples) == 1:  # the usual case: its output now, no second pass
                if reason:
                    outputs.append(self._finish(groups.pop(group.request_id), now, stops=stops))
                elif group.stream:
                    outputs.append(self.output(group, False))
            elif reason or group.stream:
                touched[req.group_id] = group
        for group in touched.values():
            if all([r.is_finished or r in stops for r in group.samples]):
                outputs.append(self._finish(groups.pop(group.request_id), now, stops=stops))
            elif group.stream:
                outputs.append(self.output(group, False, stops=stops))
        if got:
            self.iteration_tokens.observe(step_tokens)
        return list(stops.values())

    def _check_stop(self, req: Request, stop_string: bool, length: int) -> str | None:
        """The finish reason after the request's first `length` tokens, or None."""
        p, tok = req.params, req.token_ids[length - 1]
        num_output = length - len(req.prompt_token_ids)
        if (tok in req.stop_ids or stop_string) and num_output >= p.min_tokens:
            return "stop"
        if p.structured_outputs is not None and self.structured.is_complete(req, length):  # no further token
            return "stop"
        if num_output >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _check_each(self, req: Request, group: Group) -> tuple[str | None, int]:
        """Stop checks after each token the request got since the last check, as if they came one step
        each: (the finish reason, the tokens up to its stop), or (None, all its tokens). The tokens (and
        logprobs) past the first stop are for the scheduler to drop (an accepted run never overshoots)."""
        detok = group.detoks[req.index] if group.text_each_step else None
        for length in range(group.num_checked[req.index] + 1, len(req.token_ids) + 1):
            reason = self._check_stop(req, detok is not None and detok.catch_up(req.token_ids, length), length)
            if reason:
                return reason, length
        return None, len(req.token_ids)

    # -- outputs --------------------------------------------------------------------------------------
    def _finish(self, group: Group, now: float, error: str | None = None, stops=None) -> RequestOutput:
        """The final output of a group already taken out of `groups`."""
        group.finished_time = now
        return self.output(group, True, error, stops)

    def output(self, group: Group, finished: bool, error: str | None = None,
               stops: dict[Request, Finish] | None = None) -> RequestOutput:
        """The group's cumulative output (the text of one detokenized only now caught up first), as it is
        once `stops` (request -> its Finish, not applied yet) are."""
        samples, detoks = group.samples, group.detoks
        ending = [stops.get(r) for r in samples] if stops else [None] * len(samples)
        if not group.text_each_step:
            for r, d, f in zip(samples, detoks, ending):
                d.catch_up(r.token_ids, f.num_tokens if f is not None else None)
        final = finished and error is None
        outs = [_completion(r, d, final, f) for r, d, f in zip(samples, detoks, ending)]
        r = samples[0]
        if len(samples) == 1:
            first = group.first_token_times[0]
        else:
            first = min([t for t in group.first_token_times if t is not None], default=None)
        plp = r.prompt_logprobs
        scheduled = min([r.scheduled_time for r in samples if r.scheduled_time is not None], default=None)
        last = max([t for t in group.last_token_times if t is not None], default=None)
        metrics = dict(arrival_time=group.arrival, scheduled_time=scheduled, first_token_time=first,
                       last_token_time=last, finished_time=group.finished_time,
                       inter_token_latencies=group.inter_token_latencies,
                       num_preemptions=sum(s.num_preemptions for s in samples))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished,
                             r.num_cached_tokens, metrics,
                             error, r.prompt_hidden_states if finished else None,
                             prompt_logprobs=list(plp) if plp is not None else None,
                             prompt_routed_experts=_prompt_routes(r) if final else None,
                             pooled=r.pooled if final and r.params.pooling is not None else None)


def _finishing(group: Group, reason: str) -> dict[Request, Finish]:
    """Each unfinished sample of the group -> its finish with `reason`, its tokens kept."""
    return {r: Finish(r, reason, len(r.token_ids)) for r in group.samples if not r.is_finished}


def _completion(r: Request, detok: IncrementalDetokenizer, final: bool, finish: Finish | None) -> CompletionOutput:
    """One sample's part of its group's output, with its `finish` (if any) applied; its token ids and logprobs
    are copied only when read. final (finished without error): with its hidden states and routed experts,
    when asked."""
    if finish is None:
        length, reason, finished = len(r.token_ids), r.finish_reason, r.status is RequestStatus.FINISHED
    else:
        length, reason, finished = finish.num_tokens, finish.reason, True
    lps = r.logprobs
    return CompletionOutput(r.index, detok.visible_text(finished),
                            ListPrefix(r.token_ids, len(r.prompt_token_ids), length),
                            ListPrefix(lps, 0, len(lps) - len(r.token_ids) + length) if lps is not None else None,
                            reason, _completion_hidden(r, length) if final else None,
                            _completion_routes(r, length) if final else None)


def _completion_hidden(req: Request, length: int) -> np.ndarray | None:
    """The generated tokens' states, f32[num_generated, nL, D] (None unless it asked)."""
    if not req.params.return_hidden_states:
        return None
    return np.stack([req.hidden_states[i] for i in range(req.num_prompt_tokens, length)])


def _prompt_routes(req: Request) -> np.ndarray | None:
    """Sample 0's prompt tokens' routed expert ids, i32[P, L, k] (None unless it asked)."""
    if not req.params.return_routed_experts or req.routed_experts is None:
        return None
    return req.routed_experts[:req.num_prompt_tokens].copy()


def _completion_routes(req: Request, length: int) -> np.ndarray | None:
    """The generated tokens' routed expert ids but the last's, i32[G - 1, L, k] (None unless it asked)."""
    if not req.params.return_routed_experts or req.routed_experts is None:
        return None
    end = max(min(req.num_routed, length - 1), req.num_prompt_tokens)
    return req.routed_experts[req.num_prompt_tokens:end].copy()
