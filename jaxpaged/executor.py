"""Running a schedule: the runner computes it, the scheduler commits it, a failed step ends only its requests.

Two executors, one chosen at start-up (`make_executor`):
- `Executor`, the plain step: launch the step, read its result back, commit it.
- `AsyncExecutor` (async scheduling): launch step t+1 before reading step t back, so the host prepares
  the next step while the device computes; each `run` returns the requests of the step it read.

A step's order is data, not convention: the runner returns what it computed (`StepResult`), the
speculative seam (`spec_decode/decoder.py`) what its verification accepted (`Acceptance`, None without
speculation), and `Scheduler.update_from_output(out, result, accepted)` commits both at once (the one
writer of request tokens and blocks). The plain executor returns the requests that got tokens, for the
output processor (`core/output_processor.py`) to check for stops; the async one has them checked itself,
in between, and has the scheduler apply the finishes the checks return.
"""
from __future__ import annotations

import logging
import uuid

from jaxpaged.controls.kv import invalidate_kv
from jaxpaged.core.request import Request
from jaxpaged.core.scheduler import SchedulerOutput

log = logging.getLogger("jaxpaged.engine")


class FatalStepError(RuntimeError):
    """A step failure that no retry can mend (e.g. a lost multi-host follower): the engine is down."""


class Executor:
    """The plain step. `in_flight` is a step started and not read back (always None here)."""

    in_flight = None

    def __init__(self, runner, scheduler, spec, outputs):
        self.runner, self.scheduler, self.spec, self.outputs = runner, scheduler, spec, outputs
        self.num_step_failures = 0              # since start
        self.num_consecutive_step_failures = 0  # since the last step that succeeded

    def run(self, out: SchedulerOutput) -> list[Request]:
        """Compute `out` and advance its requests; returns those that got tokens."""
        if out.is_empty:
            return []
        try:
            result = self.runner.execute(out)
        except FatalStepError:  # the engine cannot step at all (a multi-host follower is lost)
            raise
        except Exception as e:  # noqa: BLE001 -- the step's requests fail; the engine carries on
            self.failed(out, e)
            return []
        self.num_consecutive_step_failures = 0
        accepted = self.spec.verify(out, result)  # what verification kept (None: no speculation)
        return self.scheduler.update_from_output(out, result, accepted)

    def failed(self, out: SchedulerOutput, error: Exception) -> None:
        """The runner raised: the step's requests (whole groups) finish with "error", the rest go on.

        A failed device call may have consumed the donated KV pool; the KV cache is then invalidated
        (`controls/kv.py`: the pool rebuilt, every running request recomputed, the prefix cache dropped)."""
        error_id = uuid.uuid4().hex[:12]
        self.num_step_failures += 1
        self.num_consecutive_step_failures += 1
        groups = list(dict.fromkeys(req.group_id for req, _ in out.scheduled))
        log.error("step failed (error id %s; requests %s): %s: %s", error_id, ", ".join(sorted(groups)),
                  type(error).__name__, error, exc_info=error)
        self.scheduler.finish_all(self.outputs.fail(
            groups, f"the step running this request failed (error id {error_id}): {type(error).__name__}"))
        if invalidate_kv(self.runner, self.scheduler, only_if_lost=True):
            log.warning("the KV pool was lost with the failed step (error id %s): %d running requests "
                        "will be recomputed", error_id, len(self.scheduler.running))


class AsyncExecutor(Executor):
    """Async scheduling: start step t+1, then read back step t (its tokens already fed to t+1 on the device).

    A request whose next step needs its last token on the host (penalties, grammars, bad words) has step t
    read back first. The requests of a step read back are checked for stops here (the output processor
    keeps their outputs for the engine's update), before the next step's tokens are appended as
    placeholders and, when read back early, before the next step is launched: a request that stopped is
    not advanced again. So `run` returns no requests of its own."""

    def run(self, out: SchedulerOutput) -> list[Request]:
        prev, self.in_flight = self.in_flight, None
        if prev is not None and (out.is_empty or any(r.needs_last_token and r in prev.pending
                                                      for r, _ in out.scheduled)):
            self._check(self._complete(prev))
            prev = None
            out = out.without_finished()
        if not out.is_empty:
            try:
                self.in_flight = self.runner.launch(out, prev, prev.pending if prev is not None else ())
            except Exception as e:  # noqa: BLE001 -- as in the plain step
                if prev is not None:
                    self._check(self._complete(prev))
                    prev = None
                if not (out := out.without_finished()).is_empty:
                    self.failed(out, e)
        if prev is not None:
            self._check(self._complete(prev))
        if self.in_flight is not None:  # computed counts advance now; the new tokens are placeholders
            self.in_flight.pending = frozenset(self.scheduler.update_from_output(self.in_flight.out, None))
        return []

    def _check(self, got: list[Request]) -> None:
        """The output processor's stop checks of a step read back (it keeps their outputs for the engine's
        update); the scheduler applies the finishes before anything further is scheduled or launched."""
        self.scheduler.finish_all(self.outputs.process(got))

    def _complete(self, step) -> list[Request]:
        """Read a launched step back and have the scheduler fill its placeholder tokens; returns the
        requests that got one (a request finished meanwhile drops its token)."""
        try:
            result = self.runner.read(step)
        except Exception as e:  # noqa: BLE001 -- the step failed on the device: so did any started after it
            self.in_flight = None  # its requests were not advanced: they run again
            self.failed(step.out.without_finished(), e)
            return []
        self.num_consecutive_step_failures = 0
        return self.scheduler.fill_placeholders(step.out, result)


def make_executor(asynchronous: bool, runner, scheduler, spec, outputs) -> Executor:
    """The engine's executor, chosen once at start-up."""
    return (AsyncExecutor if asynchronous else Executor)(runner, scheduler, spec, outputs)
