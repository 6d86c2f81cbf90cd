"""What a step hands back to the scheduler, the one writer of request state (docs/architecture.md, "Seams").

- `StepResult`: what the runner computed, read back to the host: per scheduled slot its new tokens
  (`ModelRunner.execute` / `read`, jaxpaged/step/runner.py).
- `Finish`: a request the output processor found finished (jaxpaged/core/output_processor.py).
- `Acceptance`: what speculative verification kept of each request's proposals (`SpecDecoder.verify`,
  jaxpaged/spec_decode/decoder.py).

Both are frozen values: the runner and the verifier report, and `Scheduler.update_from_output` commits
(appends the tokens, advances the computed counts, frees the rejected proposals' blocks). Host code, no jax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from jaxpaged.core.request import Request


class Sampled(NamedTuple):
    """One scheduled slot's new tokens: a plain step's one token; a verifying step's accepted proposals,
    then the target's next token. logprobs: one {token id: logprob} per token, or None (not asked)."""
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None


@dataclass(frozen=True)
class StepResult:
    """One step read back: slot -> `Sampled`, for every slot the step scheduled (a slot whose request is
    only part-way through its prompt gets a token too, which the scheduler does not commit)."""
    sampled: dict[int, Sampled]


class Accepted(NamedTuple):
    """What verification kept of one request's proposals: the accepted ones (a prefix of them, their
    logprobs or None) and how many it rejected (their K/V is not computed, their blocks are freed)."""
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    num_rejected: int


@dataclass(frozen=True)
class Acceptance:
    """A verified step's verdicts: slot -> `Accepted`, for the slots whose request proposed."""
    by_slot: dict[int, Accepted]


class Finish(NamedTuple):
    """A request the output processor finishes (stopped, aborted, failed): the scheduler finishes it with
    `reason`, its tokens (and logprobs) cut to its first `num_tokens` (tokens a multi-token step gave past
    the first stop are dropped)."""
    request: Request
    reason: str
    num_tokens: int
