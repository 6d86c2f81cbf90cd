"""SpecDecoder: the engine's speculative half on the host. Each step it

1. `propose`: gives each decoding request up to k proposals (`req.spec_token_ids`), which the scheduler
   schedules with the request's last token as one chunk of 1 + m tokens;
2. (the step verifies them on the device: verify.py)
3. `verify`: reports what the step accepted (an `Acceptance`, core/step_result.py: per request that
   proposed, its accepted proposals and how many were rejected) and records it (counters, gate, governor).
   It writes no request state: the scheduler commits the acceptance (`Scheduler.update_from_output`
   appends the accepted tokens and the target's next one, advances `num_computed_tokens` past the accepted
   tokens only, and frees the blocks that held only rejected proposals' K/V; a block is offered to the
   prefix cache only once computed tokens fill it, so rejected K/V never is).

`NoSpeculation` is the same seam when speculative decoding is off: it proposes nothing, and every step is
the plain one. Any proposer with `propose(req, k) -> list[int]` and `retain(request ids)` slots in here. One
that runs on the device (the draft model, draft.py; a draft head would too) proposes placeholders and also
has `fill(out)`: after scheduling it writes its proposals into the scheduled requests and returns its
distributions q, which the step's verifier takes (rejection sampling); the verifier does not change per
proposer.
"""
from __future__ import annotations

import dataclasses
import time

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.step_result import Acceptance, Accepted, StepResult
from jaxpaged.spec_decode.config import SpeculativeConfig, check_request
from jaxpaged.spec_decode.draft import DraftModelProposer
from jaxpaged.spec_decode.governor import Governor, RequestGate
from jaxpaged.spec_decode.ngram import NgramProposer


class NoSpeculation:
    """The engine's proposer seam with speculative decoding off: proposes nothing, changes nothing."""

    def check(self, params) -> None:
        pass

    def propose(self, running) -> None:
        pass

    def fill(self, out):
        return out

    def verify(self, out, result) -> None:
        return None

    def stats(self) -> dict:
        return {}


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, runner):
        self.k = cfg.num_speculative_tokens
        self.max_model_len = max_model_len
        self.runner = runner  # its token buckets: what a proposal costs depends on the bucket it lands in
        if cfg.method == "draft_model":  # its params and pool beside the target's (runner: mesh, blocks)
            self.proposer = DraftModelProposer(cfg.model, runner, cfg.num_speculative_tokens)
        else:
            self.proposer = NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.governor = Governor()
        self.gate = RequestGate(self.k)
        self.num_drafts = 0            # requests x steps that carried proposals
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # position j: proposals accepted at j (0-based)
        self.propose_seconds = 0.0     # time spent proposing (n-gram lookup; the draft model's run), all steps
        self._start = 0.0              # when the step in flight began proposing

    @staticmethod
    def check(params) -> None:
        """Refuse (InvalidParam) what a speculative engine cannot do for a request."""
        check_request(params)

    def propose(self, running) -> None:
        """Set `spec_token_ids` of every running request (empty unless it decodes). k is capped so that no
        proposal lies past max_tokens or max_model_len, and by the request's own recent acceptance
        (governor.RequestGate). Proposals that fit the padding of the token bucket the step takes anyway
        cost little (the verifier computes only real rows: verify.py); more of them, which push the step
        into a larger bucket, are made only where the governor expects that to pay (governor.Governor);
        else the padding goes first to the requests whose proposals are accepted most."""
        t0 = time.perf_counter()
        for req in running:
            k = min(self.k, req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - len(req.token_ids))
            ready = k > 0 and req.num_computed_tokens == len(req.token_ids) - 1
            k = self.gate.proposals(req.request_id, k) if ready else 0
            req.spec_token_ids = self.proposer.propose(req, k) if k > 0 else []
        room, order = self._room(running)
        if room is not None:  # cut to `room`: the proposals of the requests expected to keep most first
            for req in order:
                del req.spec_token_ids[room:]
                room -= len(req.spec_token_ids)
        ids = {r.request_id for r in running}
        self.proposer.retain(ids)
        self.gate.retain(ids)
        t1 = time.perf_counter()
        self.propose_seconds += t1 - t0
        self._start = t0

    def _expected(self, req) -> float:
        return self.gate.expected(req.request_id, len(req.spec_token_ids))

    def _room(self, running) -> tuple[int | None, list]:
        """How many of the proposals made this step may stay: None (all) when they fit the padding of the
        token bucket the running requests take without them; else the padding of the largest bucket the
        governor lets them take, those expected to keep most counted first (or the plain bucket's padding).
        With it, the requests that proposed in that order (empty when all stay)."""
        budget = self.runner.cfg.max_num_batched_tokens
        plain = min(sum(len(r.token_ids) - r.num_computed_tokens for r in running), budget)
        bucket, made = self.runner.bucket_for(max(plain, 1)), sum(len(r.spec_token_ids) for r in running)
        if plain + made <= bucket:
            return None, []
        order = sorted((r for r in running if r.spec_token_ids), key=self._expected, reverse=True)
        top = self.runner.bucket_for(min(plain + made, budget))
        for larger in sorted((b for b in self.runner.buckets if bucket < b <= top), reverse=True):
            left, expected = larger - plain, 0.0  # the expected accepted tokens of what fits this bucket
            for r in order:
                n = min(len(r.spec_token_ids), left)
                expected, left = expected + self._expected(r) * n / len(r.spec_token_ids), left - n
            if self.governor.allow_larger(len(running), bucket, larger, expected):
                return (None, []) if plain + made <= larger else (larger - plain, order)
        return bucket - plain, order

    def fill(self, out: SchedulerOutput) -> SchedulerOutput:
        """After scheduling: a device proposer writes its proposals into `out`'s requests; returns the
        schedule with its distributions q as `draft_probs` (`out` itself for the host n-gram proposer)."""
        fill = getattr(self.proposer, "fill", None)
        if fill is None or out.is_empty:
            return out
        t0 = time.perf_counter()
        out = dataclasses.replace(out, draft_probs=fill(out))
        self.propose_seconds += time.perf_counter() - t0
        return out

    def verify(self, out: SchedulerOutput, result: StepResult) -> Acceptance:
        """What a verified step kept of each request's proposals: `result`'s tokens of a slot that proposed
        are its accepted proposals, then the target's next token (`Verification.read_tokens`,
        spec_decode/step.py). Records the acceptance (counters, the request gate, the governor's step
        time); the scheduler commits it (`Scheduler.update_from_output`)."""
        by_slot = {}
        decoding = all(len(r.token_ids) - r.num_computed_tokens == 1 and n == 1 + len(r.spec_token_ids)
                       for r, n in out.scheduled)
        for req, _ in out.scheduled:
            d = req.spec_token_ids
            if d:
                toks, lps = result.sampled[req.slot]
                a = len(toks) - 1
                self.gate.record(req.request_id, len(d), a)
                self.num_drafts += 1
                self.num_draft_tokens += len(d)
                self.num_accepted_tokens += a
                for j in range(a):
                    self.accepted_per_pos[j] += 1
                by_slot[req.slot] = Accepted(toks[:-1], lps[:-1] if lps is not None else None, len(d) - a)
        if decoding:  # a step of decodes only (no prefill chunk): its time is the governor's figure
            self.governor.record(self.runner.bucket_for(out.num_tokens), time.perf_counter() - self._start)
        return Acceptance(by_slot)

    def stats(self) -> dict:
        """vLLM's counters (spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens, accepted
        per position), the host time proposing, and the governor's decode step time per token bucket."""
        return dict(spec_decode_num_drafts=self.num_drafts, spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(self.accepted_per_pos),
                    spec_decode_propose_seconds=self.propose_seconds,
                    spec_decode_governor=self.governor.summary())
