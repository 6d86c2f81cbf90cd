"""How many leading rows of the step's activations are live: the rest pad the token bucket the step was
compiled for (a lone decoding request is 1 row of a bucket of 8).

The step says it while it traces (`with live_rows(n):`, jaxpaged/step/traced.py); the products that can skip
rows read it (`current()`) and hand it to their kernel (the quantized CPU product: jaxpaged/models/qpacked.py);
everything else ignores it and computes every row, as it does when nothing is said (the default: None).
A padding row's product is then zero instead of a function of its (meaningless) input: the padding's
attention, KV writes and logits are discarded by the step either way.
"""
from __future__ import annotations

import contextlib
import contextvars

_LIVE = contextvars.ContextVar("jaxpaged_live_rows", default=None)


@contextlib.contextmanager
def live_rows(n):
    """Within this block, products over [M, ...] activations may treat rows n .. M-1 as padding (n: an
    int32 scalar, traced or not)."""
    token = _LIVE.set(n)
    try:
        yield
    finally:
        _LIVE.reset(token)


def current():
    """The live-row count of the enclosing `live_rows` block, or None (every row is live)."""
    return _LIVE.get()
