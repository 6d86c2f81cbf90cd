"""The runner's step sink: a seam through which each step's host inputs leave the process before the step
runs, and which runs the whole step (launch and read back). A single-process engine has `NoSink`; a
multi-host leader composes one that sends the inputs to its followers and watches the step
(jaxpaged/parallel/multihost.py)."""
from __future__ import annotations

from typing import Callable, Protocol, TypeVar

T = TypeVar("T")


class StepSink(Protocol):
    def send(self, key: tuple[int, bool, bool], batch: dict, sp: dict) -> None:
        """A step about to run: its variant (T, decode_only, verify) and host inputs (batch and sampling
        arrays, `ModelRunner.launch`)."""

    def guard(self, step: Callable[[], T]) -> T:
        """Run one whole step (`step()`: launch and read back) and return its result."""


class NoSink:
    """Nothing leaves the process; the step runs as it is."""

    def send(self, key: tuple[int, bool, bool], batch: dict, sp: dict) -> None:
        pass

    def guard(self, step: Callable[[], T]) -> T:
        return step()
