"""Weight-only quantized products on the CPU (cpu_quant.cc beside this file): built at first use by
pallas_kernels/ffi, called through the XLA FFI.

A quantized matrix W[K, N] = s[k / G, n] * (u[k, n] - zero) + m[k / G, n]: codes u (8-bit, or 4-bit), float32
scales s and an optional per-group minimum m, both [ceil(K / G), N], G in 16, 32, 64, 128 or K (one scale
per output column), an integer `zero` code (0 when m is given). int8 / int4 symmetric quantization and the
GGUF types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K are this form exactly.

The layout stores s and m as float32 or, when every one of them is a float16 value (`half_exact`: grouped
int8 / int4 quantization rounds its scales so, GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 store them so), as
float16 (`Layout.scale_bytes` 2): a group of 32 4-bit codes of one column then costs 16 + 2 (+ 2) bytes
instead of 16 + 4 (+ 4), and the product is the same, exactly.

A two-level form (`Layout.superblock` 256: GGUF's K-quants) keeps such scales at nearly the file's bytes:
per column and superblock of 256 k, a float d (and dm) in `scale_bytes`, and per group inside it an int8
sub-scale c (and sub-minimum c'), s = d * c and m = dm * c' formed in registers; a stored group is then
the superblock of 256 k, its scales (and minima) before its codes. two_level.py (beside this file) finds d
and c from float32 scales with d * c == s in float32, or says there are none (Q4_K's d * a 6-bit scale
always has them), so the product is the one-level layout's.

`pack(u, s, m, layout)` lays it out once in the kernel's order (`Layout.blob_shape`: [T, ng, group_bytes]
uint8, column tiles of 16, each a run of stored groups of codes then scales), `unpack` inverts it exactly,
`scales` gives the float32 s or m of either form and `dequantize` the float matrix.
`cpu_quant_matmul(x, w, layout)` is x [..., K] @ W -> f32[..., N] for float32 or bfloat16 x, with x
quantized per row and block of `act_block` k inside the kernel, to int8 (`act_bits` 8: scale max|x| / 127)
or to int16 codes (16: max|x| / 16319, run as two int8 planes, twice the integer dots): the product equals
the float product of those dequantized activations with W, up to float32 summation. With `act_outlier` tau > 0
(act_bits 16) only a row's outlier blocks keep int16 codes: those whose max|x| times the row's count of blocks
exceeds tau times the sum of its block maxima (float32, in block order); the others take int8 codes
(max|x| / 127) as the high plane, their low plane zero, and the kernel skips a block's second plane of dots
for a run of rows whose low planes are all zero there. A row's codes depend on that row alone.
`cpu_quant_matmuls(x, ws, layouts)` runs the products of one x with several matrices (a layer's q, k and v;
gate and up; each its own Layout) as one call: x quantized once, one work list over all their columns.
`isa()` names the best path this build runs ("avx512_vnni", "avx2", "scalar"); `isa=` caps it (tests).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ffi import load_kernel

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_quant.cc")
TARGET = "jaxpaged_cpu_quant_matmul"
GROUPS = (16, 32, 64, 128)
ACT_BLOCKS = (32, 64, 128)
ACT_BITS = {8: 127, 16: 16319}  # the activations' code width -> their largest code (the scale is max|x| / it)
ISAS = {"scalar": 0, "avx2": 1, "avx512_vnni": 3}
SUPERBLOCK = 256  # k a two-level form's d spans
_SCALE_DTYPES = {2: jnp.float16, 4: jnp.float32}  # Layout.scale_bytes -> the stored scales' type


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a packed matrix is: K x N, `group` (16, 32, 64, 128, or K: per column), `bits` (8 or 4), `zero`
    (the zero code), `has_min` (a per-group minimum is stored), `scale_bytes` (4: scales and minima
    stored as float32; 2: as float16, for values that are float16 ones) and `superblock` (0: one float scale
    a group; 256: the two-level form, a float d per 256 k and an int8 sub-scale a group, `group` 16..128;
    `scale_bytes` is then d's). Checked when made."""
    K: int
    N: int
    group: int
    bits: int
    zero: int = 0
    has_min: bool = False
    scale_bytes: int = 4
    superblock: int = 0

    def __post_init__(self):
        if self.K <= 0 or self.N <= 0:
            raise ValueError(f"layout: K and N must be positive, got K={self.K}, N={self.N}")
        if self.bits not in (4, 8):
            raise ValueError(f"layout: bits must be 4 or 8, got {self.bits}")
        if self.group not in GROUPS and self.group != self.K:
            raise ValueError(f"layout: group must be one of {GROUPS} or K={self.K}, got {self.group}")
        if not 0 <= self.zero < 2 ** self.bits or (self.has_min and self.zero):
            raise ValueError(f"layout: zero must be a {self.bits}-bit code, and 0 with a minimum; got {self.zero}")
        if self.scale_bytes not in (2, 4):
            raise ValueError(f"layout: scale_bytes must be 2 (float16) or 4 (float32), got {self.scale_bytes}")
        if self.superblock not in (0, SUPERBLOCK) or (self.superblock and self.group not in GROUPS):
            raise ValueError(f"layout: superblock must be 0 or {SUPERBLOCK} (with a group of {GROUPS}), got "
                             f"{self.superblock} (group {self.group})")

    @property
    def group_k(self) -> int:
        """The k a stored group spans: the superblock, `group`, or K rounded up to 128 for one scale per column."""
        return self.superblock or (self.group if self.group in GROUPS else -(-self.K // 128) * 128)

    @property
    def act_block(self) -> int:
        """The activation block that matches this format's scales (`cpu_quant_matmul`'s act_block for it): the
        largest of ACT_BLOCKS dividing a scale's k (`group`, the two-level form's too, or K rounded up to 128 for
        one scale a column), so the integer sums run a whole scale group between float steps; groups of 16 take
        32 (GGUF's K-quants, groups of 16 / 32: 32)."""
        k = self.group_k if not self.superblock else self.group
        return max((a for a in ACT_BLOCKS if k % a == 0), default=ACT_BLOCKS[0])

    @property
    def subgroups(self) -> int:
        """Groups a stored group holds, each with its int8 sub-scale: 256 / group for the two-level form, else 0."""
        return self.superblock // self.group

    @property
    def groups(self) -> int:
        return -(-self.K // self.group_k)

    @property
    def tiles(self) -> int:
        return -(-self.N // 16)

    @property
    def part_bytes(self) -> int:
        """Bytes of a stored group's scales (and again of its minima): 16 floats, then 16 int8 a subgroup."""
        return 16 * self.scale_bytes + 16 * self.subgroups

    @property
    def group_bytes(self) -> int:
        return self.group_k * 16 * self.bits // 8 + self.part_bytes * (1 + self.has_min)

    @property
    def blob_shape(self) -> tuple[int, int, int]:
        return (self.tiles, self.groups, self.group_bytes)

    @property
    def scale_shape(self) -> tuple[int, int]:
        """s and m's shape: one a group (of `group` k) and column."""
        return (-(-self.K // self.group), self.N) if self.superblock else (self.groups, self.N)


@functools.cache
def _library():
    """The kernel's library, built and registered once; None when it cannot be here."""
    return load_kernel(SOURCE, "JaxpagedCpuQuantMatmul", TARGET, "no quantized CPU product")


def available() -> bool:
    """The kernel is built, loaded and registered here."""
    return _library() is not None


def isa() -> str | None:
    """The best path of this build: "avx512_vnni", "avx2" or "scalar"; None when the kernel is not available."""
    lib = _library()
    return None if lib is None else {v: k for k, v in ISAS.items()}[int(lib.JaxpagedCpuQuantIsa())]


def _check(name, a, shape, dtypes):
    if tuple(a.shape) != tuple(shape) or jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in dtypes]:
        want = " or ".join(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"{name} must be {want}{list(shape)}, got {jnp.dtype(a.dtype).name}{list(a.shape)}")


def half_exact(*arrays) -> bool:
    """Whether every value of the float32 arrays (None ones skipped) is a finite float16 value, so a layout
    with `scale_bytes` 2 stores them exactly (one bool read back; the check runs where the arrays are)."""
    def exact(a):
        a = jnp.asarray(a, jnp.float32)
        return jnp.all((a.astype(jnp.float16).astype(jnp.float32) == a) & jnp.isfinite(a))
    return all(bool(exact(a)) for a in arrays if a is not None)


def _parts(a, layout: Layout, lead):
    """One of s / m: (a float32 [..., groups, N]) or, two-level, ((d, c)) -> its stored bytes [.., T, ng,
    part_bytes]: d's 16 floats (of `scale_bytes`) a tile and stored group, then c's 16 int8 a subgroup."""
    T, ng, N, d, sb = layout.tiles, layout.groups, layout.N, len(lead), layout.scale_bytes
    f, c = a if layout.superblock else (a, None)
    f = jnp.pad(jnp.asarray(f, jnp.float32), [(0, 0)] * (d + 1) + [(0, T * 16 - N)])
    f = f.reshape(*lead, ng, T, 16).swapaxes(-3, -2).astype(_SCALE_DTYPES[sb])  # [.., t, g, 16]
    out = [jax.lax.bitcast_convert_type(f, jnp.uint8).reshape(*lead, T, ng, 16 * sb)]
    if c is not None:
        ns = layout.subgroups
        c = jnp.pad(jnp.asarray(c, jnp.int8), [(0, 0)] * d + [(0, ng * ns - c.shape[-2]), (0, T * 16 - N)])
        c = c.reshape(*lead, ng, ns, T, 16).transpose(*range(d), d + 2, d, d + 1, d + 3)  # [.., t, g, j, 16]
        out.append(jax.lax.bitcast_convert_type(c, jnp.uint8).reshape(*lead, T, ng, 16 * ns))
    return out


def _unparts(b, layout: Layout, lead):
    """`_parts`' inverse: bytes [.., T, ng, part_bytes] -> a float32 [..., groups, N], or (d, c)."""
    T, ng, N, d, sb = layout.tiles, layout.groups, layout.N, len(lead), layout.scale_bytes
    f = jax.lax.bitcast_convert_type(b[..., :16 * sb].reshape(*lead, T, ng, 16, sb), _SCALE_DTYPES[sb])
    f = f.astype(jnp.float32).swapaxes(-3, -2).reshape(*lead, ng, T * 16)[..., :N]
    if not layout.superblock:
        return f
    ns, gs = layout.subgroups, layout.scale_shape[0]
    c = jax.lax.bitcast_convert_type(b[..., 16 * sb:].reshape(*lead, T, ng, ns, 16), jnp.int8)
    c = c.transpose(*range(d), d + 1, d + 2, d, d + 3).reshape(*lead, ng * ns, T * 16)[..., :gs, :N]
    return f, c


def pack(u, s, m, layout: Layout):
    """Codes u [..., K, N] (uint8, values below 2**bits), scales s and minimum m (None unless
    `layout.has_min`) [..., groups, N] float32 -> the packed w [..., T, ng, group_bytes] uint8. With
    `layout.scale_bytes` 2, s and m (two-level: their d) must be float16 values (`half_exact`; checked for
    numpy operands). Two-level (`layout.superblock`): s and m are each (d float32 [..., superblocks, N],
    c int8 [..., groups, N]), as `two_level.two_level` gives them."""
    *lead, K, N = u.shape
    if (K, N) != (layout.K, layout.N):
        raise ValueError(f"u must be [..., {layout.K}, {layout.N}] for the layout, got {list(u.shape)}")
    _check("u", u, u.shape, (jnp.uint8,))
    if (m is not None) != layout.has_min:
        raise ValueError(f"m must be given exactly when the layout has a minimum (has_min={layout.has_min})")
    for name, a in (("s", s), ("m", m)):
        if a is None:
            continue
        if layout.superblock:
            if not isinstance(a, tuple) or len(a) != 2:
                raise ValueError(f"{name} must be a (d, c) pair for the two-level layout, got {type(a).__name__}")
            _check(f"{name}'s d", a[0], (*lead, layout.groups, N), (jnp.float32,))
            _check(f"{name}'s c", a[1], (*lead, *layout.scale_shape), (jnp.int8,))
        else:
            _check(name, a, (*lead, *layout.scale_shape), (jnp.float32,))
    if isinstance(u, np.ndarray) and u.size and int(u.max()) >= 2 ** layout.bits:
        raise ValueError(f"u holds codes >= 2**{layout.bits}")
    floats = [a[0] if layout.superblock else a for a in (s, m) if a is not None]
    if layout.scale_bytes == 2 and all(isinstance(a, np.ndarray) for a in floats) and not half_exact(*floats):
        raise ValueError("s / m hold values that are not float16 ones: the layout's scale_bytes must be 4")
    G, ng, T, d = layout.group_k, layout.groups, layout.tiles, len(lead)
    lead_axes = tuple(range(d))
    up = jnp.pad(jnp.asarray(u), [(0, 0)] * d + [(0, ng * G - K), (0, T * 16 - N)])  # [..., Kp, Np]
    if layout.bits == 8:  # [.., g, q, j, t, c] -> [.., t, g, q, c, j]
        codes = up.reshape(*lead, ng, G // 4, 4, T, 16).transpose(*lead_axes, *(d + i for i in (3, 0, 1, 4, 2)))
    else:  # [.., g, o, half, j, t, c] -> [.., t, g, o, half, c, j]; low nibble: half 0
        h = up.reshape(*lead, ng, G // 8, 2, 4, T, 16).transpose(*lead_axes, *(d + i for i in (4, 0, 1, 2, 5, 3)))
        codes = h[..., 0, :, :] | (h[..., 1, :, :] << 4)
    parts = [p for a in ((s,) if m is None else (s, m)) for p in _parts(a, layout, lead)]
    codes = [codes.reshape(*lead, T, ng, -1)]
    return jnp.concatenate(parts + codes if layout.superblock else codes + parts, axis=-1)  # two-level: scales first


def unpack(w, layout: Layout):
    """The exact inverse of `pack`: w [..., T, ng, group_bytes] -> (u [..., K, N], s, m or None), s and m
    float32 [..., groups, N] or, two-level, (d, c) pairs."""
    *lead, T, ng, gb = w.shape
    _check("w", w, (*lead, *layout.blob_shape), (jnp.uint8,))
    G, d, K, N = layout.group_k, len(lead), layout.K, layout.N
    lead_axes = tuple(range(d))
    cb, pb = G * 16 * layout.bits // 8, layout.part_bytes
    c0 = pb * (1 + layout.has_min) if layout.superblock else 0  # two-level: the scales come first
    s0 = 0 if layout.superblock else cb
    codes = w[..., c0:c0 + cb]
    if layout.bits == 8:  # [.., t, g, q, c, j] -> [.., g, q, j, t, c]
        up = codes.reshape(*lead, T, ng, G // 4, 16, 4).transpose(*lead_axes, *(d + i for i in (1, 2, 4, 0, 3)))
    else:  # [.., t, g, o, half, c, j] -> [.., g, o, half, j, t, c]
        c = codes.reshape(*lead, T, ng, G // 8, 1, 16, 4)
        h = jnp.concatenate([c & 15, c >> 4], axis=-3)
        up = h.transpose(*lead_axes, *(d + i for i in (1, 2, 3, 5, 0, 4)))
    u = up.reshape(*lead, ng * G, T * 16)[..., :K, :N]
    s = _unparts(w[..., s0:s0 + pb], layout, lead)
    return u, s, (_unparts(w[..., s0 + pb:s0 + 2 * pb], layout, lead) if layout.has_min else None)


def scales(a, layout: Layout):
    """s or m as `unpack` gives it -> float32 [..., groups, N] (two-level: d of each group's superblock
    times its c, exactly)."""
    if not layout.superblock:
        return a
    d, c = a
    return d[..., jnp.arange(c.shape[-2]) // layout.subgroups, :] * c.astype(jnp.float32)


def dequantize(w, layout: Layout):
    """The float32 matrix [..., K, N] a packed w stands for: s * (u - zero) + m."""
    u, s, m = unpack(w, layout)
    idx = jnp.arange(layout.K) // layout.group
    out = scales(s, layout)[..., idx, :] * (u.astype(jnp.float32) - layout.zero)
    return out if m is None else out + scales(m, layout)[..., idx, :]


def cpu_quant_matmul(x, w, layout: Layout, *, layer=None, rows=None, act_block: int = 32, act_bits: int = 8,
                     act_outlier: float = 0.0, isa: str | None = None):
    """x [..., K] (float32 or bfloat16) @ the packed w ([T, ng, group_bytes], or a stack [L, ...] read at
    `layer`, an int32 scalar, traced or not) -> f32[..., N]. rows (an int32 scalar, traced or not; default
    all): how many leading rows of x (flattened to [M, K]) are live; the others pad a token bucket and give
    zeros, not computed. act_block: the k each activation scale covers (32, 64 or 128); act_bits: the
    activations' codes, int8 (8) or int16 (16: 128 times finer, up to twice the CPU time where the product
    is compute-bound); act_outlier: with act_bits 16, tau > 0 keeps int16 codes only in a row's outlier
    blocks (max|x| above tau times the mean of the row's block maxima) and gives the others int8 codes,
    whose second plane of integer dots is then skipped (0: int16 codes in every block); isa: the most
    capable path to run (default: the build's best)."""
    return _products(x, (w,), (layout,), True, layer, rows, act_block, act_bits, act_outlier, isa)[0]


def cpu_quant_matmuls(x, ws, layouts, *, layer=None, rows=None, act_block: int = 32, act_bits: int = 8,
                      act_outlier: float = 0.0, isa: str | None = None) -> tuple:
    """(x @ w for w, layout in zip(ws, layouts)) in one call, each exactly as `cpu_quant_matmul` gives it: the
    products of one x (a layer's q, k and v; gate and up), x quantized once, the column tiles of every
    matrix one work list for the threads. Each w has its own Layout (the same K: group, bits, zero,
    minimum and scale bytes may differ), all stacked under the same `layer` or none. -> a tuple of
    f32[..., N_i]."""
    ws, layouts = tuple(ws), tuple(layouts)
    if not ws or len(ws) != len(layouts):
        raise ValueError(f"cpu_quant_matmuls needs one layout a matrix, at least one: got {len(ws)} ws and "
                         f"{len(layouts)} layouts")
    return _products(x, ws, layouts, False, layer, rows, act_block, act_bits, act_outlier, isa)


def _products(x, ws, layouts, single: bool, layer, rows, act_block, act_bits, act_outlier, isa) -> tuple:
    """The kernel call of x with every (w, layout): operands checked first, errors naming them (w and layout
    when `single`, else ws[i] and layouts[i])."""
    stacked = layer is not None
    for i, (w, layout) in enumerate(zip(ws, layouts)):
        name, lname = ("w", "layout") if single else (f"ws[{i}]", f"layouts[{i}]")
        if not isinstance(layout, Layout):
            raise ValueError(f"{lname} must be a Layout, got {type(layout).__name__}")
        if layout.K != layouts[0].K:
            raise ValueError(f"{lname} must have K={layouts[0].K} (every matrix multiplies the same x), got "
                             f"{layout.K}")
        if (tuple(w.shape[stacked:]) != layout.blob_shape or len(w.shape) != 3 + stacked
                or jnp.dtype(w.dtype) != jnp.uint8):
            want = ("L, " if stacked else "") + ", ".join(map(str, layout.blob_shape))
            raise ValueError(f"{name} must be the packed uint8[{want}] of {layout}, got "
                             f"{jnp.dtype(w.dtype).name}{list(w.shape)}")
    K = layouts[0].K
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) or x.shape[-1:] != (K,):
        raise ValueError(f"x must be float32 or bfloat16 [..., {K}], got {jnp.dtype(x.dtype).name}{list(x.shape)}")
    if stacked and len({w.shape[0] for w in ws}) != 1:
        raise ValueError(f"the stacks in ws must hold as many layers, got {[w.shape[0] for w in ws]}")
    if act_block not in ACT_BLOCKS:
        raise ValueError(f"act_block must be one of {ACT_BLOCKS}, got {act_block}")
    if act_bits not in ACT_BITS:
        raise ValueError(f"act_bits must be one of {tuple(ACT_BITS)}, got {act_bits!r}")
    finite = isinstance(act_outlier, (int, float, np.floating)) and 0 <= act_outlier < float("inf")
    if not finite or (act_outlier and act_bits != 16):
        raise ValueError(f"act_outlier must be a finite number >= 0, and 0 unless act_bits is 16; got "
                         f"{act_outlier!r} (act_bits {act_bits})")
    if isa is not None and isa not in ISAS:
        raise ValueError(f"isa must be one of {tuple(ISAS)} or None, got {isa!r}")
    if not available():
        raise RuntimeError("the quantized CPU matmul kernel is not available here (see the log for why)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    live = jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32).reshape(())
    call = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct((x2.shape[0], a.N), jnp.float32) for a in layouts],
                            vmap_method="sequential")
    each = lambda f: np.array([f(a) for a in layouts], np.int64)  # noqa: E731 (an attribute a product)
    ys = call(x2, ws[0], index, live, *ws[1:], K=np.int64(K), N=each(lambda a: a.N), group=each(lambda a: a.group),
              bits=each(lambda a: a.bits), zero=each(lambda a: a.zero), has_min=each(lambda a: a.has_min),
              scale_bytes=each(lambda a: a.scale_bytes), superblock=each(lambda a: a.superblock),
              act_block=np.int64(act_block), act_bits=np.int64(act_bits), act_outlier=np.float32(act_outlier),
              isa=np.int64(ISAS[isa or "avx512_vnni"]))
    return tuple(y.reshape(lead + (a.N,)) for y, a in zip(ys, layouts))
