"""A weight-only quantized matrix as a small pytree (`QArray`), made on the host by `quantize` or from codes.

`QArray(q, scale, dtype, m=None, group=0, bits=8, zero=0)` stands for the matrix `s * q + m`, where
    q      int8 signed codes (or float8_e4m3fn), the matrix's shape: `u - zero` for unsigned codes u;
    scale  float32, the matrix's rank; on the reduced axis one entry per group of `group` entries
           (group 0: the whole axis, one scale per output column or embedding row);
    m      None, or a float32 per-group minimum shaped like `scale` (GGUF Q4_1 / Q4_K ..);
    dtype  (static) the engine dtype the matrix stands for; group, bits (8 or 4: the codes' width), zero
           (the unsigned zero code) are static too.
The reduced axis is -2 for matrices [..., in, out] (scale [..., ceil(in / G), out]) and -1 for the
embedding [V, D] (scale [V, ceil(D / G)]): the one where `scale` and `q` differ in size. Every operation on
the whole pytree that maps leaves (stacking, slicing a layer, sharding) treats q, scale and m alike.

The CPU kernel's format (pallas_kernels/matmul/cpu_quant.py) is W = s * (u - z) + m with unsigned codes u,
so a QArray of integer codes maps onto it exactly (u = q + zero): `jaxpaged/models/qpacked.py` packs it.
`quantize` makes int8 / int4 symmetric (zero 128 / 8, no m), int4 with a per-group minimum (codes 0..15,
zero 0, m: llama.cpp's Q4_1 form) or int8 with one (codes 0..255 stored as q = u - 128, zero 128, m the
minimum plus 128 scales: `folded_minimum`; the kernel gets the minimum back, zero 0). GGUF's Q5_1 / Q5_K,
5-bit codes with a minimum, fit as 8-bit codes with zero 0 (`from_codes`). Grouped, it picks
scales and minima that are float16 values (`half_scales`) and rounds the codes with them, so the kernel's
layout stores them in two bytes each, exactly.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# format -> (storage dtype, largest representable magnitude, code bits)
FORMATS = {"int8": (np.dtype(np.int8), 127.0, 8), "int4": (np.dtype(np.int8), 7.0, 4),
           "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0, 8)}
QUANTIZATIONS = (None,) + tuple(FORMATS)
GROUPS = (16, 32, 64, 128)  # group sizes; 0 (or -1): one group over the whole reduced axis
DEFAULT_GROUP = {"int8": 32, "int4": 32, "fp8": 0}
# int4 and int8: a per-group minimum by default (llama.cpp's Q4_1 / Q4_K form). int8 in groups of 32 with a
# minimum (and the kernel's int16 activations: qpacked.AUTO_ACT_BITS) meets issue 44's quality goal on the
# default model (0.002 mean |delta logprob|; per channel 0.034, symmetric groups of 32 0.023) for an eighth
# of a byte a weight more; docs/benchmarks.md has the measurements.
DEFAULT_SYMMETRIC = {"int8": False, "int4": False, "fp8": True}
HALF_MIN_NORMAL, HALF_MAX = 2.0 ** -14, 65504.0  # float16's smallest normal and largest finite value
MIN_ZERO_INT8 = 128  # int8 with a minimum: the stored code q = u - 128 of code u in 0..255 (`folded_minimum`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    q: jax.Array       # int8 (signed codes) or float8_e4m3fn, the matrix's shape
    scale: jax.Array   # float32, groups on the reduced axis (see the module docstring)
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))  # what it stands for
    m: jax.Array | None = None  # float32 per-group minimum, shaped like scale
    group: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: the whole reduced axis
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))   # the codes' width: 8 or 4
    zero: int = dataclasses.field(default=0, metadata=dict(static=True))   # unsigned code = q + zero

    @property
    def shape(self) -> tuple:
        return tuple(self.q.shape)

    @property
    def format(self) -> str:
        if np.dtype(self.q.dtype) != np.int8:
            return "fp8"
        return "int4" if self.bits == 4 else "int8"

    @property
    def axis(self) -> int:
        """The reduced axis: -1 (rows of the embedding) or -2 (columns of a matrix)."""
        return -1 if self.scale.shape[-1] != self.q.shape[-1] else -2

    @classmethod
    def from_codes(cls, u, s, m=None, zero: int = 0, group: int = 32, bits: int = 4,
                   dtype: str = "float32") -> QArray:
        """The matrix W[..., K, N] = s[..., k // group, n] * (u[..., k, n] - zero) + m[..., k // group, n] from
        unsigned codes u (uint8, each below 2**bits; 4-bit codes one per byte, unpacked), float32 scales s and
        optional minimum m [..., ceil(K / group), N]; group in 16, 32, 64, 128, or 0 for one group over K.
        Host (numpy) arrays; every operand is checked (ValueError naming it): s and m finite, codes in range.
        int8 / int4 symmetric (zero 128 / 8) and GGUF Q8_0 (zero 128), Q4_0 (8), Q5_0 (16), Q6_K (group 16,
        zero 32), Q4_1 / Q5_1 / Q4_K / Q5_K (zero 0, m the negated scaled minimum) are this form exactly."""
        u = np.asarray(u)
        if u.dtype != np.uint8 or u.ndim < 2:
            raise ValueError(f"u must be uint8 codes [..., K, N], got {u.dtype}{list(u.shape)}")
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        if u.size and int(u.max()) >= 2 ** bits:
            raise ValueError(f"u holds codes >= 2**{bits} (bits={bits})")
        check_group(group, "group")
        if not (0 <= zero < 2 ** bits) or (m is not None and zero):
            raise ValueError(f"zero must be a {bits}-bit code, and 0 when m is given; got {zero!r}")
        K = u.shape[-2]
        want = (*u.shape[:-2], -(-K // group) if group else 1, u.shape[-1])
        s = check_scales(s, want, "s")
        m = None if m is None else check_scales(m, want, "m")
        q = u.astype(np.int16) - zero
        if q.size and (int(q.min()) < -128 or int(q.max()) > 127):
            raise ValueError(f"zero={zero}: the signed codes u - zero must fit int8")
        q = q.astype(np.int8)
        return cls(q, s, dtype, m, int(group), int(bits), int(zero))


def restored(q, scale, axis: int, m=None, form=None) -> QArray:
    """A QArray saved by `jaxpaged convert` (jaxpaged/checkpoints/weights.py save_orbax_params): with its
    `form` ([group, bits, zero]) and minimum `m`, the QArray saved, its operands checked (ValueError naming
    the operand: a form that is not one, scales or minimum of the wrong shape or not finite, codes outside
    the form's range); without (a checkpoint saved as {q, scale} alone) its group read back from the scale's
    size on the reduced axis (the smallest group giving that many; codes restored as 8-bit ones)."""
    if form is None:
        n, count = q.shape[axis], scale.shape[axis]
        group = 0 if count == 1 else next((g for g in GROUPS if -(-n // g) == count), None)
        if group is None:
            raise ValueError(f"a saved quantized matrix [{n} on its reduced axis] has {count} scales: no group fits")
        integer = np.dtype(q.dtype) == np.int8
        return QArray(q, scale, "float32", None, group, 8, 128 if integer else 0)
    group, bits, zero = (int(v) for v in np.asarray(form).reshape(-1))
    check_group(group, "group")
    if bits not in (4, 8) or not 0 <= zero < 2 ** bits or (m is not None and zero not in (0, _min_zero(bits))):
        raise ValueError(f"form [group, bits, zero] = {[group, bits, zero]} is not a quantized form (bits 4 or 8, "
                         f"zero a code of that width; with a minimum 0, or {MIN_ZERO_INT8} for 8 bits)")
    want = list(q.shape)
    want[axis] = -(-want[axis] // group) if group else 1
    scale = check_scales(scale, tuple(want), "scale")
    m = None if m is None else check_scales(m, tuple(want), "m")
    if np.dtype(q.dtype) == np.int8 and q.size:
        lo, hi = int(q.min()) + zero, int(q.max()) + zero
        if lo < 0 or hi >= 2 ** bits:
            raise ValueError(f"q holds codes outside 0..{2 ** bits - 1} (q + zero in {lo}..{hi}, bits={bits})")
    return QArray(q, scale, "float32", m, group, bits, zero)


def _min_zero(bits: int) -> int:
    """The zero code a minimum form may have besides 0: MIN_ZERO_INT8 for 8-bit codes (`folded_minimum`)."""
    return MIN_ZERO_INT8 if bits == 8 else 0


def check_group(group, name: str = "quantization_group_size") -> None:
    """ValueError naming `name` unless group is one of GROUPS or 0 (one group over the reduced axis)."""
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or (group and group not in GROUPS):
        raise ValueError(f"{name} must be one of {', '.join(map(str, GROUPS))}, or 0 / -1 for one scale per "
                         f"output channel; got {group!r}")


def check_scales(s, shape: tuple, name: str) -> np.ndarray:
    """s as float32 of `shape`, finite; ValueError naming `name` otherwise."""
    s = np.asarray(s)
    if s.dtype != np.float32 or tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name} must be float32{list(shape)}, got {s.dtype}{list(s.shape)}")
    bad = ~np.isfinite(s)
    if bad.any():
        raise ValueError(f"{name} holds {int(bad.sum())} NaN / inf value(s) (first at {np.argwhere(bad)[0].tolist()})")
    return s


def check_quantization(quantization) -> None:
    """ValueError naming `quantization` unless it is None, "int8", "int4" or "fp8"."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, 'int8', 'int4' or 'fp8', got {quantization!r}")


def group_of(fmt: str, group_size: int | None) -> int:
    """The group a format quantizes with: `group_size` (None: the format's default; -1 / 0: per channel)."""
    if group_size is None:
        return DEFAULT_GROUP[fmt]
    g = 0 if group_size == -1 else group_size
    check_group(g)
    if g and fmt == "fp8":
        raise ValueError(f"quantization_group_size={group_size}: fp8 takes one scale per output channel (0 / -1)")
    return int(g)


def symmetric_of(fmt: str, symmetric: bool | None) -> bool:
    """Whether a format quantizes symmetrically: `symmetric` (None: the format's default, DEFAULT_SYMMETRIC)."""
    symmetric = DEFAULT_SYMMETRIC[fmt] if symmetric is None else symmetric
    check_symmetric(fmt, symmetric)
    return symmetric


def check_symmetric(fmt: str, symmetric, name: str = "quantization_symmetric") -> None:
    """ValueError naming `name` unless symmetric is a bool the format takes: a per-group minimum (False)
    is int4's and int8's (codes 0..255 stored as signed bytes: `folded_minimum`), not fp8's."""
    if not isinstance(symmetric, bool):
        raise ValueError(f"{name} must be True or False, got {symmetric!r}")
    if not symmetric and fmt not in ("int4", "int8"):
        raise ValueError(f"{name}=False (a per-group minimum) takes quantization 'int4' or 'int8', not {fmt!r}: "
                         f"{fmt} is symmetric")


def _expand(a, group: int, n: int, axis: int):
    """Per-group values -> one per entry of the reduced axis (length n)."""
    if not group:
        return a
    xp = np if isinstance(a, np.ndarray) else jnp
    return xp.take(a, xp.arange(n) // group, axis=axis)


def quantize(a: np.ndarray, fmt: str, axis: int, dtype: str = "float32", group: int = 0,
             name: str = "tensor", symmetric: bool = True) -> QArray:
    """Host array -> QArray of numpy arrays, one scale per group of `group` entries along `axis` (0: the
    whole axis; axis=-2: the columns of [..., in, out]; axis=-1: the rows of the embedding [V, D]).
    symmetric: int8 / int4 codes q = round(a / s) in [-127, 127] / [-7, 7], s = max|a| / 127 (/ 7), zero
    code 128 / 8. Not symmetric (int4 and int8: `check_symmetric`): codes u = round((a - m) / s) in [0, 15]
    (int4) with the group's minimum m and s = (max - min) / 15, zero code 0 (llama.cpp's Q4_1 form: a matrix
    of Q4_1 values in groups aligned with its blocks comes back exactly, up to float32 rounding); int8: u in
    [0, 255], s = (max - min) / 255, stored as q = u - 128 (`folded_minimum`: Q4_1 values come back to
    within float16 rounding of s, as 17 int8 steps are one Q4_1 step).
    Grouped int8 / int4 (group > 0) take float16 values as scales and minima (`half_scales`), the codes
    rounded with them; a tensor whose scales float16 cannot hold to its relative precision keeps float32 ones.
    A NaN or inf in `a` is refused by `name`."""
    check_quantization(fmt)
    check_group(group, "group")
    check_symmetric(fmt, symmetric, "symmetric")
    store, top, bits = FORMATS[fmt]
    a = np.asarray(a, np.float32)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name!r} holds NaN / inf values: it cannot be quantized ({fmt})")
    n, ax = a.shape[axis], axis % a.ndim
    if group:  # [.., n, ..] -> [.., groups, group, ..] (edge padded: no new extremes), reduced over the group
        pad = [(0, 0)] * a.ndim
        pad[ax] = (0, -n % group)
        ap = np.pad(a, pad, mode="edge")
        sh = list(ap.shape)
        sh[ax:ax + 1] = [sh[ax] // group, group]
        grouped, red = ap.reshape(sh), ax + 1
    else:
        grouped, red = np.expand_dims(a, ax), ax + 1
    if not symmetric:
        lo, hi = np.min(grouped, axis=red), np.max(grouped, axis=red)
        levels = 2 ** bits - 1
        scale, lo = _asymmetric_scales(lo, hi, levels, half=bool(group))
        zero, m = zero_code(fmt, symmetric), lo.astype(np.float32)
        if zero:  # int8: codes 0..255 stored as q = u - 128: s * u + lo = s * q + (lo + 128 s)
            scale, lo, m = folded_minimum(lo, hi, scale, half=bool(group))
        u = np.clip(np.rint((a - _expand(lo, group, n, axis)) / _expand(scale, group, n, axis)), 0, levels)
        return QArray((u - zero).astype(store), scale, dtype, m, group, bits, zero)
    amax = np.max(np.abs(grouped), axis=red)
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    if group and fmt != "fp8":
        scale = half_scales(scale)
    x = a / _expand(scale, group, n, axis)
    q = np.clip(np.rint(x), -top, top).astype(store) if fmt != "fp8" else x.astype(store)
    return QArray(q, scale, dtype, None, group, bits, zero_code(fmt, symmetric))


def zero_code(fmt: str, symmetric: bool) -> int:
    """The zero code of `quantize`'s QArrays (u = q + zero): 2^(bits - 1) symmetric (128 / 8), 0 for fp8 and
    int4 with a minimum, MIN_ZERO_INT8 for int8 with one (`folded_minimum`)."""
    bits = FORMATS[fmt][2]
    if fmt == "fp8":
        return 0
    if symmetric:
        return 2 ** (bits - 1)
    return MIN_ZERO_INT8 if bits == 8 else 0


def folded_minimum(lo: np.ndarray, hi: np.ndarray, scale: np.ndarray,
                   half: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 with a minimum (`quantize`): codes u in 0..255 over [lo, lo + 255 s] are stored as q = u - 128,
    so the QArray's minimum is m = lo + 128 s, and the kernel's layout (zero code 0 with a minimum:
    qpacked.pack) gets lo back as m - 128 s. Returns (scale, lo, m) with m = lo + 128 s exactly, so the fold
    is exact both ways and the packed matrix is the QArray's exactly (float64, which holds those sums of
    float32 values exactly, says which are). A group whose sum would round (its range far below its minimum,
    or scales and minimum not float16 values) takes instead a power of two p >= 2 (hi - lo) / 255 as its
    scale (>= 2^-14 when `half`) and its minimum rounded down to a multiple of 128 p: the sum is exact, the
    codes still span [lo, hi] (< 128 + 127.5 steps), each value within half its (at most 4x finer) step."""
    def fold(lo, scale):
        off = np.float32(MIN_ZERO_INT8) * scale
        m = (lo + off).astype(np.float32)
        m64, off64, lo64 = (x.astype(np.float64) for x in (m, off, lo))
        return m, (m64 - off64 == lo64) & (lo64 + off64 == m64)
    m, exact = fold(lo, scale)
    if not exact.all():
        need = np.maximum((hi - lo) / np.float32(255), np.abs(lo) * np.float32(2.0 ** -30))
        p = 2 * np.exp2(np.ceil(np.log2(np.maximum(need, np.float32(HALF_MIN_NORMAL if half else 2.0 ** -100)))))
        off = np.float32(MIN_ZERO_INT8) * p.astype(np.float32)
        scale = np.where(exact, scale, p).astype(np.float32)
        lo = np.where(exact, lo, np.floor(lo / off) * off).astype(np.float32)
        m, _ = fold(lo, scale)  # exact: lo and m are multiples n, n + 1 of 128 p with |n| <= 2^22
    return scale, lo, m


def half_scales(scale: np.ndarray) -> np.ndarray:
    """Float32 scales -> each the nearest float16 value (relative change <= 2^-11: codes rounded with it
    stay in range, a value's error stays <= half its scale), so the kernel's layout stores them in two bytes;
    unchanged (the tensor keeps float32 scales) when some scale is not a normal float16 (below 2^-14 or
    above 65504: float16 would change it by more)."""
    s16 = _half(scale)
    return s16 if _normal_half(s16) else scale


def _half(a: np.ndarray, down: bool = False) -> np.ndarray:
    """float32 -> the nearest float16 value (down: the largest one not above), as float32 (inf past 65504)."""
    with np.errstate(over="ignore"):  # past float16's range: inf, refused by the callers
        h = a.astype(np.float16)
    if down:
        h = np.where(h.astype(np.float32) > a, np.nextafter(h, np.float16(-np.inf)), h)
    return h.astype(np.float32)


def _normal_half(s: np.ndarray) -> bool:
    return bool(np.all((s >= HALF_MIN_NORMAL) & (s <= HALF_MAX)))


def _asymmetric_scales(lo: np.ndarray, hi: np.ndarray, levels: int, half: bool) -> tuple[np.ndarray, np.ndarray]:
    """(scale, minimum) per group of values in [lo, hi] coded 0..levels. With `half` both float16 values:
    the minimum rounded down (every value stays at or above it), then the scale spanning [minimum, hi]
    rounded to the nearest (`half_scales`); float32 ones when float16 cannot hold them so."""
    def steps(lo):
        step = ((hi - lo) / np.float32(levels)).astype(np.float32)
        return np.where(step > 0, step, np.float32(1.0))  # one value (or a denormal range): codes 0
    lo = lo.astype(np.float32)
    if half:
        m16 = _half(lo, down=True)
        s16 = _half(steps(m16))
        if _normal_half(s16) and np.all(np.isfinite(m16)):
            return s16, m16
    return steps(lo), lo


def dequantize(w) -> jax.Array | np.ndarray:
    """The matrix a QArray stands for, in its dtype (a plain array is returned as it is)."""
    if not isinstance(w, QArray):
        return w
    xp = np if isinstance(w.q, np.ndarray) else jnp
    return dequantize_parts(w.q.astype(xp.float32), w.scale, w.m, w.group, w.axis).astype(w.dtype)


def dequantize_parts(q, scale, m, group: int, axis: int):
    """s * q + m of a QArray's (or a slice's) parts, float32, the scales expanded over their groups."""
    n = q.shape[axis]
    out = q * _expand(scale, group, n, axis)
    return out if m is None else out + _expand(m, group, n, axis)
