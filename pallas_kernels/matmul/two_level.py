"""The two-level scale form of the quantized CPU kernel's layout (cpu_quant.py, `Layout.superblock`) found
from float32 scales: per column and superblock of 256 k a float d, per group an int8 c, d * c the scale
exactly. GGUF's K-quants (d * a 6-bit sub-scale) always have it; scales quantized one group at a time
generally do not, and are told apart from the first 16 columns."""
from __future__ import annotations

import numpy as np

from pallas_kernels.matmul.cpu_quant import Layout


def two_level(a, layout: Layout):
    """Float32 scales (or minima) a [..., groups, N] of a two-level `layout` -> (d float32 [..., superblocks,
    N], c int8 [..., groups, N]) with d * c == a exactly in float32 (d the groups' common dyadic divisor, or
    that less an odd factor where this makes d a float16 value and keeps c in int8), or None when there are
    none (an a / d outside int8, a NaN or an infinity). numpy, on the host; the first 16 columns are tried
    first, so scales without the form are told apart quickly."""
    a = np.asarray(a, np.float32)
    *lead, gs, N = a.shape
    if (gs, N) != layout.scale_shape or not layout.superblock:
        return None
    nsub, nsb = layout.subgroups, layout.groups
    ap = np.pad(a, [(0, 0)] * len(lead) + [(0, nsb * nsub - gs), (0, 0)]).reshape(*lead, nsb, nsub, N)
    if N > 16 and _factor(ap[..., :16]) is None:
        return None
    dc = _factor(ap)
    return None if dc is None else (dc[0][..., 0, :], dc[1].reshape(*lead, nsb * nsub, N)[..., :gs, :])


def _factor(ap):
    """`two_level` on the superblocks ap [..., nsb, nsub, N] -> (d [..., nsb, 1, N], c int8 like ap) or None."""
    if not np.isfinite(ap).all():
        return None
    frac, exp = np.frexp(ap)  # ap = frac * 2**exp, |frac| in [0.5, 1): an integer of 24 bits times 2**(exp - 24)
    n = (frac * np.float32(2 ** 24)).astype(np.int32)
    e = np.where(n != 0, exp - 24, np.iinfo(np.int32).max)
    low = e.min(axis=-2, keepdims=True)  # [.., nsb, 1, N]
    low = np.where(low == np.iinfo(np.int32).max, 0, low)
    # ap / 2**low: integers below 2**31 where the spread is at most 7 (a c over 127 otherwise: fails below)
    g = np.maximum(np.gcd.reduce(n << np.minimum(e - low, 7), axis=-2, keepdims=True), 1)  # [.., nsb, 1, N]
    # d = g 2**low; where g's odd part has over 11 bits, the least odd h that leaves d / h a float16 value
    # (so the layout can store d in two bytes) with c * h still in int8
    odd = g // (g & -g)
    big = np.nonzero(odd >= 2048)
    if big[0].size:
        ob, cmax = odd[big], np.abs(ap).max(axis=-2, keepdims=True)[big] / np.ldexp(g[big].astype(np.float32),
                                                                                      low[big])
        h = np.ones_like(ob)
        for k in range(127, 1, -2):  # the least fitting k wins: it is written last
            h = np.where((ob % k == 0) & (ob // k < 2048) & (cmax * k <= 127), k, h)
        g[big] //= h
    d = np.ldexp(g.astype(np.float32), low)  # exact: g's odd part has at most 24 bits
    c = np.rint(ap / d)
    if c.max(initial=0) > 127 or c.min(initial=0) < -128 or not np.isfinite(d).all() or \
            not np.array_equal(d * c, ap):
        return None
    return d, c.astype(np.int8)
