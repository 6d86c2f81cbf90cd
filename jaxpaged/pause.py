"""Pause / resume generation (vLLM's `pause_generation` / `resume_generation`), for RL loops that update
weights between rollouts.

Modes of `LLMEngine.pause_generation(mode)`:
- "abort": every unfinished request finishes now (finish_reason "abort"; its output is returned).
- "wait": running requests run to their end; waiting ones (and those added meanwhile) are not admitted.
  The engine counts as paused at once; `is_draining` tells when the running ones are done.
- "keep": nothing more is computed; running requests keep their slots, tokens and KV. An
  `update_weights` while paused sends them back to be recomputed under the new weights (their KV is of
  the old ones) and flushes the prefix cache; after `resume_generation` they continue where they were,
  their next tokens drawn with the same seeds and generation indices as if nothing had happened.
In every mode requests may still be added while paused; they wait for `resume_generation`. A step
already started on the device (async scheduling) is read back first, so the outputs it carries are
returned by the pause.
"""
from __future__ import annotations

import time
from collections import deque

from jaxpaged.core.scheduler import SchedulerOutput

PAUSE_MODES = ("abort", "wait", "keep")


class PauseState:
    """The engine's pause: the mode, and for "wait" the requests being drained."""

    def __init__(self, mode: str, drain: set):
        self.mode, self.drain = mode, drain


def pause(engine, mode: str, wait: bool = True) -> list:
    """Pause `engine` (an LLMEngine) in `mode`; return the outputs this produced (module docstring).
    wait (mode "wait" only): step until the running requests are done before returning; False leaves
    the draining to the caller's steps (the async engine's loop)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    outputs = _read_inflight(engine)
    engine.pause_state = PauseState(mode, set(engine.scheduler.running) if mode == "wait" else set())
    if mode == "abort":
        outputs += _abort_all(engine)
    while wait and is_draining(engine):
        outputs += engine.step()
    return outputs


def is_draining(engine) -> bool:
    """Paused with "wait" while some request that was running at the pause has not finished."""
    state = engine.pause_state
    return state is not None and state.mode == "wait" and (engine._inflight is not None or any(not r.is_finished for r in state.drain))


def paused_step(engine) -> list:
    """`LLMEngine.step` while paused: "wait" advances the drained requests only (their preempted ones
    included); otherwise only a step already on the device is read back."""
    state = engine.pause_state
    if not (state.mode == "wait" and is_draining(engine)):
        return _read_inflight(engine)
    sch = engine.scheduler
    held = [r for r in sch.waiting if r not in state.drain]
    sch.waiting = deque(r for r in sch.waiting if r in state.drain)
    try:
        return engine._step()
    finally:
        sch.waiting.extend(held)


def settle(engine) -> None:
    """Async scheduling: read back a step still in flight once every request has finished (the step
    after the last stop); it carries no output."""
    if not engine.scheduler.has_unfinished():
        _read_inflight(engine)


def check_update_allowed(engine) -> None:
    """update_weights needs no running computation: an idle engine, or one paused and not draining."""
    settle(engine)
    if engine.has_unfinished_requests() and (engine.pause_state is None or is_draining(engine)):
        raise RuntimeError("update_weights: the engine has unfinished requests; update between generate "
                           "calls, abort them, or pause_generation(mode='keep') first")


def recompute_kept(engine) -> None:
    """After the weights changed under paused requests: their KV is recomputed when they resume."""
    engine.scheduler.recompute_all()


def _read_inflight(engine) -> list:
    """Read back a step started on the device (async scheduling) and not read yet; its outputs."""
    if engine._inflight is None:
        return []
    return engine._step_async(SchedulerOutput())


def _abort_all(engine) -> list:
    """Finish every unfinished request with "abort"; their final outputs."""
    outputs, now = [], time.monotonic()
    for group_id, group in list(engine.groups.items()):
        for req in group.samples:
            engine.scheduler.abort(req)
        group.finished_time = now
        del engine.groups[group_id]
        outputs.append(engine._output(group, True))
    return outputs
