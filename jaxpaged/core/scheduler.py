"""Continuous batching: which requests advance by how many tokens this step, within the budgets.

Prefill and decode are one thing: a request catches up `num_computed_tokens` to `len(token_ids)`.
Running requests go first (oldest first), then waiting ones are admitted FCFS into free slots. When a
running request cannot get a block, the newest running request is preempted (its blocks freed, back to
the front of the waiting queue, recomputed later).

The scheduler is the one writer of request state (docs/architecture.md, "One owner per state"): it
commits what the others report (core/step_result.py) — the runner's tokens and the verifier's acceptance
(`update_from_output`, `fill_placeholders`), the output processor's finishes (`finish_all`) — and alone
appends to a request's `token_ids` or has its block manager free its blocks (tests/test_layout.py holds
the first).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.step_result import Acceptance, Finish, StepResult

PLACEHOLDER = -1  # a token sampled on the device, not read back yet (async scheduling)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens), slot order
    num_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    placeholders: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, slot, index)
    draft_probs: object = None  # speculative decoding with a draft model: its q, f32[S, K, V] on the device

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for _, n in self.scheduled)

    def without_finished(self) -> SchedulerOutput:
        """A copy less the requests finished since scheduling (stopped one step late, aborted)."""
        scheduled = [(r, n) for r, n in self.scheduled if not r.is_finished]
        return dataclasses.replace(self, scheduled=scheduled, num_tokens=sum(n for _, n in scheduled),
                                   placeholders=[])


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int | None = None):
        """max_loras: at most this many distinct LoRA adapters among the running requests (None: LoRA off),
        so every step's adapters fit the device slots; a waiting request whose adapter would exceed it
        waits (FCFS) until an adapter's last running request leaves."""
        self.bm = block_manager
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))  # pop() gives slot 0 first
        self.num_preemptions = 0
        self.admit = None    # held (`hold`): only waiting requests it accepts are admitted (None: all)
        self.advance = True  # held without advancing: nothing is scheduled

    # -- queue ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        """Finish a request wherever it is (running, waiting); frees its blocks and slot."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        else:
            self.waiting.remove(req)
            self.bm.free(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    def _release(self, req: Request) -> None:
        self.bm.free(req)
        self.free_slots.append(req.slot)
        req.slot = None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def recompute_all(self) -> None:
        """Send every running request back to waiting, to be recomputed from scratch (its K/V is lost)."""
        out = SchedulerOutput()
        for req in reversed(list(self.running)):  # newest first: the oldest ends at the queue's front
            self._preempt(req, out)

    def hold(self, admit=lambda req: False, advance: bool = False) -> None:
        """Hold requests back (a pause): only the waiting requests `admit` accepts are admitted (the
        others keep their places), and the running ones are advanced only with `advance`."""
        self.admit, self.advance = admit, advance

    def release(self) -> None:
        """Undo `hold`."""
        self.admit, self.advance = None, True

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.advance:
            return out
        budget = self.max_num_batched_tokens
        steps: dict[int, tuple[Request, int]] = {}
        capacity = self.bm.block_size
        windowed = self.bm.sliding_window is not None  # blocks may go behind the window at any step
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            behind = len(req.token_ids) - req.num_computed_tokens
            n = min(behind + len(req.spec_token_ids), budget)  # proposals: after the last token, if it fits
            del req.spec_token_ids[max(n - behind, 0):]
            if req.num_computed_tokens + n <= len(req.block_ids) * capacity and not windowed:
                steps[req.slot] = (req, n)  # its blocks hold this step already (most decode steps)
                budget -= n
                continue
            while not self.bm.allocate(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                steps.pop(victim.slot, None)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                steps[req.slot] = (req, n)
                budget -= n
        budget = self.max_num_batched_tokens - sum(n for _, n in steps.values())
        adapters = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        queue = self.waiting if self.admit is None else deque(r for r in self.waiting if self.admit(r))
        while queue and self.free_slots and budget > 0 and not out.preempted:
            req = queue[0]
            if self.max_loras and req.lora_int_id and req.lora_int_id not in adapters \
                    and len(adapters) >= self.max_loras:
                break  # its adapter would not fit the device slots: wait for one to leave
            sib = req.sibling
            if sib is not None and sib.status is RequestStatus.RUNNING \
                    and sib.num_computed_tokens < sib.num_prompt_tokens:
                break  # wait for sample 0's prompt, then share its blocks
            # prompt logprobs or routed experts still missing: compute the prompt, do not match it
            # (step/prompt_logprobs.py, step/routed_experts.py)
            cached = 0 if req.needs_prompt_logprobs or req.needs_routes else self.bm.match_prefix(req)
            n = min(len(req.token_ids) - cached, budget)
            if not self.bm.allocate(req, cached + n):
                self.bm.free(req)
                break
            queue.popleft()
            if queue is not self.waiting:
                self.waiting.remove(req)
            if req.num_preemptions == 0 and req.num_output_tokens == 0:
                req.num_cached_tokens = cached
            req.num_computed_tokens = cached
            req.status, req.slot = RequestStatus.RUNNING, self.free_slots.pop()
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            if req.lora_int_id:
                adapters.add(req.lora_int_id)
            steps[req.slot] = (req, n)
            budget -= n
        out.scheduled = [steps[s] for s in sorted(steps)]
        out.num_tokens = sum(n for _, n in out.scheduled)
        return out

    def num_deferred(self) -> int:
        """Waiting requests held back by a transient constraint rather than by capacity (vLLM's 'deferred'
        reason): an adapter that would not fit the LoRA slots, a later sample waiting for sample 0's prompt."""
        adapters = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        full = bool(self.max_loras) and len(adapters) >= self.max_loras
        return sum(1 for r in self.waiting
                   if (full and r.lora_int_id and r.lora_int_id not in adapters)
                   or (r.sibling is not None and r.sibling.status is RequestStatus.RUNNING
                       and r.sibling.num_computed_tokens < r.sibling.num_prompt_tokens))

    def update_from_output(self, out: SchedulerOutput, result: StepResult | None,
                           accepted: Acceptance | None = None) -> list[Request]:
        """Commit a step: advance computed counts; append each request's new tokens when it caught up;
        free the blocks of rejected proposals. Returns the requests that got tokens.

        result: the runner's (`StepResult`); a request that proposed commits what `accepted` (the
        verifier's `Acceptance`) kept of its proposals, then the target's next token. Stop conditions on
        tokens are the output processor's (`finish_all` applies them). result None (async scheduling: the
        tokens are still on the device): each such request gets the placeholder PLACEHOLDER, its index and
        slot kept in `out.placeholders` for `fill_placeholders`.
        """
        got = []
        block_size, caching = self.bm.block_size, self.bm.enable_prefix_caching
        verdicts = accepted.by_slot if accepted is not None else None
        for req, n in out.scheduled:
            if req.status is not RequestStatus.RUNNING:
                continue
            if verdicts and (verdict := verdicts.get(req.slot)) is not None:
                # its accepted proposals are its tokens now; the rejected ones never were
                n -= verdict.num_rejected
                req.token_ids.extend(verdict.token_ids)
                if req.logprobs is not None:
                    req.logprobs.extend(verdict.logprobs)
                req.spec_token_ids = []
            req.num_computed_tokens += n
            if caching and req.num_computed_tokens >= (req.num_registered_blocks + 1) * block_size:
                self.bm.cache_blocks(req)  # a block filled up
            if req.num_computed_tokens == len(req.token_ids):
                if result is None:
                    out.placeholders.append((req, req.slot, len(req.token_ids)))
                    req.token_ids.append(PLACEHOLDER)
                    got.append(req)
                    continue
                toks, lps = result.sampled[req.slot]
                req.token_ids.append(toks[-1])
                if req.logprobs is not None:
                    req.logprobs.append(lps[-1] if lps else None)
                got.append(req)
        if accepted is not None:  # blocks past the computed tokens held only rejected proposals' K/V
            for req, _ in out.scheduled:
                if not req.is_finished:
                    self.bm.trim(req, req.num_computed_tokens)
        return got

    def fill_placeholders(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Async scheduling: put a step's tokens, read back now, in place of its placeholders; returns the
        requests that got one. A request finished meanwhile (stopped one step earlier, aborted) drops it."""
        got = []
        for req, slot, i in out.placeholders:
            if not req.is_finished:
                toks, lps = result.sampled[slot]
                req.token_ids[i] = toks[-1]
                if req.logprobs is not None:
                    req.logprobs.append(lps[-1] if lps else None)
                got.append(req)
        return got

    def finish_all(self, finishes: list[Finish]) -> None:
        """Apply the output processor's finishes: each request cut to its kept tokens, then finished."""
        for req, reason, num_tokens in finishes:
            drop = len(req.token_ids) - num_tokens
            if drop:
                del req.token_ids[num_tokens:]
                if req.logprobs is not None:
                    del req.logprobs[len(req.logprobs) - drop:]
            self.finish(req, reason)

    def abort(self, req: Request) -> None:
        self.finish(req, "abort")
