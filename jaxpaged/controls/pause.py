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
returned by the pause. The pause holds the scheduler (`Scheduler.hold`): the engine's step is unchanged.
"""
from __future__ import annotations

from jaxpaged.core.scheduler import SchedulerOutput

PAUSE_MODES = ("abort", "wait", "keep")


class PauseControl:
    """An engine's pause: the mode (None: not paused), and for "wait" the requests being drained."""

    def __init__(self, engine):
        self.engine = engine
        self.mode: str | None = None
        self.drain: set = set()

    @property
    def is_paused(self) -> bool:
        return self.mode is not None

    def pause(self, mode: str, wait: bool = True) -> list:
        """Pause in `mode`; return the outputs this produced (module docstring). wait (mode "wait" only):
        step until the running requests are done before returning; False leaves the draining to the
        caller's steps (the async engine's loop)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        engine = self.engine
        outputs = self.read_in_flight()
        self.mode, self.drain = mode, set(engine.scheduler.running) if mode == "wait" else set()
        if mode == "wait":  # the drained requests (preempted ones too) advance; nothing else is admitted
            engine.scheduler.hold(admit=self.drain.__contains__, advance=True)
        else:
            engine.scheduler.hold()
        if mode == "abort":
            aborted, finishes = engine.outputs.abort_all()
            engine.scheduler.finish_all(finishes)
            outputs += aborted
        while wait and self.is_draining:
            outputs += engine.step()
        return outputs

    def resume(self) -> None:
        """Undo `pause`: waiting and kept requests are scheduled again."""
        self.mode, self.drain = None, set()
        self.engine.scheduler.release()

    @property
    def is_draining(self) -> bool:
        """Paused with "wait" while some request that was running at the pause has not finished."""
        return self.mode == "wait" and (self.engine.executor.in_flight is not None
                                        or any(not r.is_finished for r in self.drain))

    def read_in_flight(self) -> list:
        """Read back a step started on the device (async scheduling) and not read yet; its outputs."""
        engine = self.engine
        if engine.executor.in_flight is None:
            return []
        return engine.update(engine.executor.run(SchedulerOutput()))

    def check_update_allowed(self) -> None:
        """update_weights (and sleep) need no running computation: an idle engine, or one paused and not
        draining. A step still in flight once every request has finished (async scheduling: the step
        after the last stop, it carries no output) is read back first."""
        engine = self.engine
        if not engine.scheduler.has_unfinished():
            self.read_in_flight()
        if engine.has_unfinished_requests() and (not self.is_paused or self.is_draining):
            raise RuntimeError("update_weights: the engine has unfinished requests; update between generate "
                               "calls, abort them, or pause_generation(mode='keep') first")
