"""An integer QArray kept in the quantized CPU kernel's packed layout (`QPacked`), made once at placement.

On one CPU device the runner packs its integer matrices (int8 / int4, any group, with or without a minimum:
`packable`) into pallas_kernels/matmul/cpu_quant.py's layout: column tiles of 16, each a run of groups of
codes then their scales (and minima), so a product reads the packed bytes once, in order, and multiplies them
with integer-quantized activations (`quant.dot`; `act_bits_of`: for 8-bit weights int16 codes in each row's
outlier blocks and int8 in the others, int8 for 4-bit, unless the engine's `quantization_activation_bits`
says otherwise). A stack [L, K, N] is packed whole and the
kernel reads layer i in place (`quant.LayerOf`). `unpack` is the exact inverse (the QArray it was made from),
which `get_weights`, weight updates and the XLA reference use. A matrix whose scales and minima are all
float16 values (grouped int8 / int4 quantization makes them so, GGUF's legacy types store them so) keeps them
in two bytes each (`scale_bytes` 2), any other in four. Scales that are a float per 256 k times small integers
(GGUF's K-quants: d * a 6-bit sub-scale, generally no float16) take the kernel's two-level form (`superblock`
256: that float, and an int8 a group) where it is smaller. The choices are made from the values, so the packed
matrix is always the QArray's exactly.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models import live_rows
from jaxpaged.models.qarray import QArray, dequantize_parts
from pallas_kernels.matmul import cpu_quant
from pallas_kernels.matmul.two_level import two_level

# The kernel's activation codes per weight-code width (`act_bits_of` with no choice). int8 weights take int16
# activations in a row's outlier blocks (AUTO_ACT_OUTLIER: max|x| above 1.5 times the mean of the row's block
# maxima; ~14% of the default model's blocks) and int8 in the others: int8 codes everywhere, per 32 k, cost the
# default model's int8 (groups of 32 with a minimum) 0.036 mean |delta logprob| against float32, int16
# everywhere 0.002 (XLA's float product's) but twice the integer dots at many rows; the outlier blocks alone
# 0.017 (issue 44's goal: <= 0.02) at close to int8's dots. int4 weights keep int8 activations (within int4's
# goal of 0.1). docs/benchmarks.md, *Quantization and KV cache dtype: quality*.
AUTO_ACT_BITS = {8: 16, 4: 8}
AUTO_ACT_OUTLIER = {8: 1.5, 4: 0.0}


def act_bits_of(bits: int, choice: int | None = None) -> int:
    """The activation codes (8 or 16 bits) the kernel multiplies `bits`-bit weight codes with: `choice`
    (the engine's quantization_activation_bits), None: AUTO_ACT_BITS."""
    if choice not in (None, *cpu_quant.ACT_BITS):
        raise ValueError(f"quantization_activation_bits must be one of {tuple(cpu_quant.ACT_BITS)} or None, "
                         f"got {choice!r}")
    return AUTO_ACT_BITS[bits] if choice is None else int(choice)


def act_outlier_of(bits: int, choice: int | None = None) -> float:
    """The outlier cut (`cpu_quant_matmul`'s act_outlier) with `act_bits_of(bits, choice)`: AUTO_ACT_OUTLIER
    with no choice, 0 (one code width in every block) for a chosen width."""
    act_bits_of(bits, choice)
    return AUTO_ACT_OUTLIER[bits] if choice is None else 0.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QPacked:
    """blob uint8 [..., T, ng, group_bytes]: the packed matrix [..., K, N] of `cpu_quant.Layout` (K, N,
    group or K, bits, zero, has_min, scale_bytes); `dtype` (static) is the engine dtype it stands for, `group` the
    QArray's (0: one group over K), `zero` the QArray's (with a minimum the layout's is 0: `_folded`).
    `transposed`: a tied embedding [V = N, D = K] packed as the lm_head it also is (its rows, the vocabulary,
    are the kernel's columns; `take_rows` reads the lookup from it)."""
    blob: jax.Array
    K: int = dataclasses.field(metadata=dict(static=True))
    N: int = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(metadata=dict(static=True))
    zero: int = dataclasses.field(metadata=dict(static=True))
    has_min: bool = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))  # a tied embedding [N, K]
    scale_bytes: int = dataclasses.field(default=4, metadata=dict(static=True))  # 2: float16 scales and minima
    superblock: int = dataclasses.field(default=0, metadata=dict(static=True))  # 256: the two-level scale form
    act_bits: int = dataclasses.field(default=8, metadata=dict(static=True))  # the activations' codes: 8 or 16
    act_outlier: float = dataclasses.field(default=0.0, metadata=dict(static=True))  # 16 only in outlier blocks

    @property
    def layout(self) -> cpu_quant.Layout:
        return cpu_quant.Layout(self.K, self.N, self.group or self.K, self.bits, 0 if self.has_min else self.zero,
                                self.has_min, self.scale_bytes, self.superblock)

    @property
    def shape(self) -> tuple:
        return (*self.blob.shape[:-3], *((self.N, self.K) if self.transposed else (self.K, self.N)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def format(self) -> str:
        return "int4" if self.bits == 4 else "int8"

    @property
    def axis(self) -> int:
        return -1 if self.transposed else -2

    @property
    def sharding(self):
        return self.blob.sharding

    def unpack(self) -> QArray:
        """The QArray this was packed from (jnp arrays), exactly."""
        a = _unpack(self.blob, self.layout, self.group, self.dtype, self.zero)
        return _transposed(a) if self.transposed else a


def _transposed(a: QArray) -> QArray:
    """A 2-D QArray transposed, scales (and minimum) with it: the embedding [V, D] <-> the head [D, V]."""
    return dataclasses.replace(a, q=a.q.T, scale=a.scale.T, m=None if a.m is None else a.m.T)


def packable(a) -> bool:
    """An integer QArray matrix [..., K, N] (scales over its columns' groups) the kernel takes packed."""
    return (isinstance(a, QArray) and a.format in ("int8", "int4") and a.axis == -2 and a.q.ndim in (2, 3)
            and isinstance(a.q, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)))


def _codes(a: QArray):
    """The unsigned codes u = q + zero (uint8) of an integer QArray."""
    return (a.q.astype(jnp.int16) + a.zero).astype(jnp.uint8)


def pack(a: QArray, donate: bool = False, transposed: bool = False, scale_bytes: int | None = None,
         superblock: int | None = None, act_bits: int | None = None) -> QPacked:
    """An integer QArray (`packable`; with `transposed` an embedding [V, D] with row scales, packed as the
    head [D, V]) -> its QPacked (on a's devices). donate: a's arrays are freed. superblock: 256 (the
    two-level scale form) or 0; None: 256 exactly when the scales and minima have one (`two_level.two_level`)
    and it is the smaller blob. scale_bytes: 2 (float16) or 4 for the floats stored (the two-level form's
    d); None: 2 exactly when every one is a float16 value (`cpu_quant.half_exact`). A form the values do
    not have is refused (ValueError). act_bits: the activations' codes its products take (`act_bits_of`,
    `act_outlier_of`)."""
    if transposed:
        a = _transposed(a)
    K, N = a.q.shape[-2:]
    a = _folded(a)
    spec = QPacked(None, K, N, a.group, a.bits, a.zero, a.m is not None, a.dtype, transposed,
                   act_bits=act_bits_of(a.bits, act_bits), act_outlier=act_outlier_of(a.bits, act_bits))
    s, m = a.scale, a.m
    two = _two_level(a, spec) if superblock != 0 else None
    if superblock == cpu_quant.SUPERBLOCK and two is None:
        raise ValueError(f"a quantized matrix [{K}, {N}] has scales or minima with no two-level form (a float per "
                         f"{cpu_quant.SUPERBLOCK} k times int8 ones): its packed layout must be one-level "
                         f"(superblock={superblock} asked)")
    floats = (s, m) if two is None else tuple(p[0] for p in two if p is not None)
    exact = cpu_quant.half_exact(*floats)
    if scale_bytes == 2 and not exact:
        raise ValueError(f"a quantized matrix [{K}, {N}] has scales or minima that are not float16 values: its "
                         f"packed layout must keep them in 4 bytes (scale_bytes=2 asked)")
    spec = dataclasses.replace(spec, scale_bytes=scale_bytes or (2 if exact else 4))
    if two is not None:
        flat = spec.layout
        spec = dataclasses.replace(spec, superblock=cpu_quant.SUPERBLOCK)
        if superblock is None and spec.layout.groups * spec.layout.group_bytes >= flat.groups * flat.group_bytes:
            spec = dataclasses.replace(spec, superblock=0, scale_bytes=scale_bytes or
                                       (2 if cpu_quant.half_exact(a.scale, a.m) else 4))
        else:
            s, m = two
    blob = _pack(_codes(a), s, m, spec.layout)
    if donate:  # freed once packed (not donated to the jit: no output has the codes' shape to reuse them)
        for x in (a.q, a.scale, a.m):
            if isinstance(x, jax.Array):
                x.delete()
    return dataclasses.replace(spec, blob=blob)


def _two_level(a: QArray, spec: QPacked):
    """a's (scale, minimum) in the two-level form ((d, c) pairs, the minimum's None without one), or None
    when they have none (or a's group does not fit in a superblock)."""
    if a.group not in cpu_quant.GROUPS:
        return None
    layout = dataclasses.replace(spec, superblock=cpu_quant.SUPERBLOCK).layout
    s = two_level(a.scale, layout)
    m = None if a.m is None else two_level(a.m, layout)
    return None if s is None or (a.m is not None and m is None) else (s, m)


def _folded(a: QArray) -> QArray:
    """A QArray with a minimum and a zero code z (int8's: qarray.folded_minimum) with its minimum as the
    kernel's layout takes it, zero 0: s * (u - z) + m = s * u + (m - z s), its `zero` field kept (the codes
    u = q + z stay). ValueError naming the matrix where m - z s does not give m back exactly (the packed
    matrix would not be the QArray): only `qarray.quantize`'s minima are made to fold."""
    if a.m is None or not a.zero:
        return a
    off = jnp.float32(a.zero) * jnp.asarray(a.scale, jnp.float32)
    m = jnp.asarray(a.m, jnp.float32) - off
    if not bool(jnp.all((m + off == a.m) & (a.m - m == off))):
        raise ValueError(f"a quantized matrix {list(a.q.shape)} with zero code {a.zero} has a minimum m that "
                         f"m - {a.zero} * scale does not give back exactly: it cannot be packed")
    return dataclasses.replace(a, m=m)


@functools.partial(jax.jit, static_argnums=3)
def _pack(u, s, m, layout):
    return cpu_quant.pack(u, s, m, layout)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _unpack(blob, layout, group: int, dtype: str, zero: int) -> QArray:
    u, s, m = cpu_quant.unpack(blob, layout)
    q = (u.astype(jnp.int16) - zero).astype(jnp.int8)
    s = cpu_quant.scales(s, layout)
    m = None if m is None else cpu_quant.scales(m, layout)
    if m is not None and zero:  # the minimum unfolded (`_folded`)
        m = m + jnp.float32(zero) * s
    return QArray(q, s, dtype, m, group, layout.bits, zero)


def pack_abstract(a: QArray, transposed: bool = False, act_bits: int | None = None) -> QPacked:
    """Shapes only (an abstract runner's leaves): the QPacked that `pack` would make of the quantization at
    load (float16 scales when grouped: `qarray.quantize`), its sharding kept."""
    K, N = a.q.shape[-2:][::-1] if transposed else a.q.shape[-2:]
    spec = QPacked(None, K, N, a.group, a.bits, a.zero, a.m is not None, a.dtype, transposed,
                   2 if a.group else 4, act_bits=act_bits_of(a.bits, act_bits),
                   act_outlier=act_outlier_of(a.bits, act_bits))
    shape = (*a.q.shape[:-2], *spec.layout.blob_shape)
    return dataclasses.replace(spec, blob=jax.ShapeDtypeStruct(shape, jnp.uint8,
                                                                sharding=getattr(a.q, "sharding", None)))


def matmul(x, w: QPacked, layer=None):
    """x [..., K] @ the packed w (a stack read at `layer` when given) -> f32[..., N] on the kernel (x in
    float32 or bfloat16; other float types are widened to float32), x quantized to w's `act_bits`. Inside a
    `live_rows` block of the step, x [M, K]'s padding rows are skipped (zeros)."""
    return matmuls(x, (w,), layer)[0]


def matmuls(x, ws, layer=None) -> tuple:
    """(matmul(x, w, layer) for w in ws) as one kernel call (`cpu_quant.cpu_quant_matmuls`: x quantized once,
    one fan-out over every matrix's columns), each product exactly as `matmul` gives it: a layer's q, k and
    v, or gate and up, all stacks read at the same `layer` (or none); x quantized once, to the widest
    `act_bits` among them (int16: with the smallest outlier cut of the matrices that ask for int16), per the
    smallest activation block among their layouts (`cpu_quant.Layout.act_block`: a block per scale group, up to
    128 k)."""
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        x = x.astype(jnp.float32)
    rows = live_rows.current() if x.ndim == 2 else None  # the step's live rows of x [M, K]
    ws = tuple(ws)
    act_bits = max(w.act_bits for w in ws)
    outlier = min(w.act_outlier for w in ws if w.act_bits == act_bits) if act_bits == 16 else 0.0
    block = min(w.layout.act_block for w in ws)  # the finest any of them needs (each divides the larger ones)
    if len(ws) == 1:
        return (cpu_quant.cpu_quant_matmul(x, ws[0].blob, ws[0].layout, layer=layer, rows=rows, act_block=block,
                                           act_bits=act_bits, act_outlier=outlier),)
    return cpu_quant.cpu_quant_matmuls(x, [w.blob for w in ws], [w.layout for w in ws], layer=layer, rows=rows,
                                       act_block=block, act_bits=act_bits, act_outlier=outlier)


def pack_quantized(params: dict, owned: bool = False, like: dict | None = None, act_bits: int | None = None) -> dict:
    """The parameters with their integer layer matrices and lm_head `QPacked` (a tied embedding packed as
    the head: `transposed`; shapes only for abstract leaves). owned: the QArrays are the caller's alone
    and are freed as they are packed. like: parameters packed before (a runner's, replaced by these):
    each matrix keeps the `scale_bytes` and `superblock` of its packed counterpart there, so the step's
    shapes stay. act_bits: the engine's quantization_activation_bits (`act_bits_of`)."""
    def one(a, before, transposed=False):
        fits = (isinstance(a, QArray) and a.format in ("int8", "int4") and a.axis == -1 and a.q.ndim == 2
                if transposed else packable(a))
        if not fits:
            return a
        if isinstance(a.q, jax.ShapeDtypeStruct):
            return pack_abstract(a, transposed, act_bits)
        if isinstance(before, QPacked):
            return pack(a, owned, transposed, scale_bytes=before.scale_bytes, superblock=before.superblock,
                        act_bits=act_bits)
        return pack(a, donate=owned, transposed=transposed, act_bits=act_bits)

    def prior(*path):
        tree = like or {}
        for k in path:
            tree = tree.get(k, {}) if isinstance(tree, dict) else {}
        return tree
    out = {**params, "layers": {k: one(a, prior("layers", k)) for k, a in params["layers"].items()}}
    if "lm_head" in params:
        out["lm_head"] = one(params["lm_head"], prior("lm_head"))
    else:  # tied: the embedding is the head too
        out["embed"] = one(params["embed"], prior("embed"), transposed=True)
    return out


def take_rows(w: QPacked, ids, dtype=None):
    """Rows ids [T] of a packed tied embedding (`transposed`) -> [T, D] in the engine dtype: the 16-column
    tiles holding them gathered from the packed head and unpacked (16 vocabulary entries read a token)."""
    n = ids.shape[0]
    tiles = w.blob[ids // 16]  # [T, ng, group_bytes]
    layout = dataclasses.replace(w.layout, N=16 * n)
    u, s, m = cpu_quant.unpack(tiles, layout)  # [K, 16T]; s, m float32 [groups, 16T] or (d, c) pairs
    s, m = cpu_quant.scales(s, layout), None if m is None else cpu_quant.scales(m, layout)
    cols = jnp.arange(n) * 16 + ids % 16
    q = u[:, cols].astype(jnp.float32) - w.layout.zero  # [K, T]; m (if any) the layout's
    rows = dequantize_parts(q, s[:, cols], None if m is None else m[:, cols], w.group, -2)
    return rows.T.astype(dtype or w.dtype)
