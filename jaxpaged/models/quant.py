"""Weight-only quantization: the products that read quantized matrices (QArray, jaxpaged/models/qarray.py),
the CPU kernels' packed leaves, and the parameter pytree's conversion.

`dot(x, w)` works for plain arrays, QArrays and packed leaves. A QArray with one scale per output column
(no minimum): x @ q (q widened to x's dtype inside the product) then one multiply by the column scales;
a grouped one (int4, grouped int8, GGUF blocks): the matrix dequantized in x's dtype, a chunk of columns
at a time for wide ones, then XLA's dot — the reference, and the path on GPU / TPU. On one CPU device the
runner keeps integer QArrays packed for the quantized CPU kernel (`QPacked`, jaxpaged/models/qpacked.py),
which reads the packed bytes once a step. Quantizing (`quantize`) runs on the host (numpy), one tensor at
a time, at load or conversion.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxpaged.models import live_rows, packed, qpacked
from jaxpaged.models.packed import LAYER_MATRICES, Packed
from jaxpaged.models.qarray import QArray, check_quantization, dequantize, dequantize_parts, quantize
from jaxpaged.models.qpacked import QPacked
from jaxpaged.step.batch_invariant import row_tiled
from pallas_kernels.matmul import cpu as cpu_matmul

COLUMN_CHUNK = 4096  # columns of a wide quantized matrix widened at a time (see `dot`)
# layer leaves that are quantized (with `embed` and `lm_head`: see `leaf_axis`); norms, biases and the
# MoE router stay in the engine dtype
QUANTIZED_LAYER_LEAVES = LAYER_MATRICES
EMBED_GROUP = 32  # the int8 embedding / lm_head's group along the hidden axis (as GGUF's Q8_0; see leaf_format)


@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer `index` (an int32 scalar, traced in the layer loop) of the stacked matrices `stack` [L, in, out],
    not sliced out: `dot` with the CPU matmul kernel reads it in place (a sliced operand of a custom call is
    a copy of the layer's weights every step); anything else slices it (`get`). Lives inside a trace only."""
    stack: jax.Array
    index: jax.Array | int

    @property
    def shape(self) -> tuple:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    def get(self) -> jax.Array:
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.stack)
        return layer.unpack() if isinstance(layer, (Packed, QPacked)) else layer


_unpack = jax.jit(Packed.unpack)


def unpack_layers(params: dict) -> dict:
    """The inverse of `packed.pack_layers` and `qpacked.pack_quantized`: every `Packed` leaf as the plain
    matrix it stands for (a new array), every `QPacked` one as its QArray."""
    def one(a):
        if isinstance(a, QPacked):
            return a.unpack() if isinstance(a.blob, jax.Array) else a
        if not isinstance(a, Packed):
            return a
        if isinstance(a.tiles, jax.ShapeDtypeStruct):  # an offloaded runner's: shapes only
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        return _unpack(a)
    return jax.tree.map(one, params, is_leaf=lambda a: isinstance(a, (Packed, QPacked)))


def _live(x):
    """The step's live-row count for a product over x [M, in] (models/live_rows.py), None otherwise."""
    return live_rows.current() if x.ndim == 2 else None


def dot(x, w, preferred_element_type=None, *, transpose: bool = False, row_tile: int = 0, kernel: bool = False):
    """x [..., in] @ w [in, out] (w [out, in] when `transpose`: the tied embedding as the lm_head) for a
    plain array or a QArray, the scales of the output columns applied to the product.

    The result has x's dtype, or preferred_element_type when given (the logits ask for float32).
    A wide QArray (out >= 2 * COLUMN_CHUNK, the lm_head) is multiplied COLUMN_CHUNK output columns at a
    time in a loop, so XLA widens one chunk at a time instead of the whole matrix every step.
    row_tile > 0 (batch-invariant steps, jaxpaged/step/batch_invariant.py): x [M, in] is multiplied
    row_tile rows at a time, so every row rounds alike whatever M is.
    kernel (`ModelConfig.cpu_matmul`, resolved by jaxpaged/step/matmul.py): a plain bfloat16 matrix of a
    shape it takes is multiplied by the CPU matmul kernel (pallas_kernels/matmul/cpu.py), float32
    accumulation as XLA's; anything else by XLA's dot. A `QPacked` w (the runner packs them only where the
    quantized kernel runs: jaxpaged/step/matmul.py) is multiplied by the quantized CPU kernel."""
    if row_tile:  # each tile is its own [row_tile, in]: the step's live-row count does not apply to it
        with live_rows.live_rows(None):
            return row_tiled(lambda t: dot(t, w, preferred_element_type, transpose=transpose, kernel=kernel), x,
                             row_tile)
    out_dtype = preferred_element_type or x.dtype
    if isinstance(w, LayerOf) and isinstance(w.stack, QPacked):  # packed only where the kernel runs
        return qpacked.matmul(x, w.stack, layer=w.index).astype(out_dtype)
    if isinstance(w, QPacked):
        if transpose != w.transposed:
            raise ValueError(f"dot: a packed {'embedding' if w.transposed else 'matrix'} multiplies with "
                             f"transpose={w.transposed}, got transpose={transpose}")
        return qpacked.matmul(x, w).astype(out_dtype)
    if isinstance(w, LayerOf):
        if kernel and isinstance(w.stack, Packed) and x.dtype == jnp.bfloat16:
            return cpu_matmul.cpu_matmul(x, w.stack.tiles, layer=w.index, packed=True,
                                         rows=_live(x)).astype(out_dtype)
        if kernel and cpu_matmul.supported(x, w.stack, transpose, stacked=True):
            return cpu_matmul.cpu_matmul(x, w.stack, transpose, layer=w.index, rows=_live(x)).astype(out_dtype)
        w = w.get()
    if isinstance(w, Packed):
        if transpose != w.transposed:
            raise ValueError(f"dot: a packed {'embedding' if w.transposed else 'matrix'} multiplies with "
                             f"transpose={w.transposed}, got transpose={transpose}")
        if kernel and x.dtype == jnp.bfloat16:
            return cpu_matmul.cpu_matmul(x, w.tiles, packed=True, rows=_live(x)).astype(out_dtype)
        w = w.unpack()
    if kernel and not isinstance(w, QArray) and cpu_matmul.supported(x, w, transpose):
        return cpu_matmul.cpu_matmul(x, w, transpose, rows=_live(x)).astype(out_dtype)
    out_axis = 0 if transpose else 1  # w is one 2-D matrix (a layer's slice inside the layer loop)
    contract = ((x.ndim - 1,), (1 - out_axis,))  # w.T is never built: it made XLA CPU copy the matrix
    if not isinstance(w, QArray):
        return jax.lax.dot_general(x, w, (contract, ((), ())), preferred_element_type=_accumulator(x, out_dtype)
                                   ).astype(out_dtype)

    def product(q, scale, m):  # q: w's columns (or rows when transposed) [.., C ..]; scale, m: their groups
        if w.group or m is not None:  # grouped: the chunk dequantized in x's dtype, then a plain product
            wq = dequantize_parts(q.astype(jnp.float32), scale, m, w.group, w.axis).astype(x.dtype)
            y = jax.lax.dot_general(x, wq, (contract, ((), ())), preferred_element_type=jnp.float32)
            return y.astype(out_dtype)
        y = jax.lax.dot_general(x, q.astype(x.dtype), (contract, ((), ())), preferred_element_type=jnp.float32)
        return (y * scale.reshape(-1)).astype(out_dtype)
    n = w.q.shape[out_axis]
    if n < 2 * COLUMN_CHUNK or n % COLUMN_CHUNK:
        return product(w.q, w.scale, w.m)

    def chunk(i, y):
        q, s, m = (None if a is None else jax.lax.dynamic_slice_in_dim(a, i * COLUMN_CHUNK, COLUMN_CHUNK,
                                                                      axis=out_axis) for a in (w.q, w.scale, w.m))
        return jax.lax.dynamic_update_slice_in_dim(y, product(q, s, m), i * COLUMN_CHUNK, axis=-1)
    return jax.lax.fori_loop(0, n // COLUMN_CHUNK, chunk, jnp.zeros(x.shape[:-1] + (n,), out_dtype))


def dots(x, ws, preferred_element_type=None, *, row_tile: int = 0, kernel: bool = False) -> tuple:
    """(dot(x, w) for w in ws), each as `dot` gives it. Where the CPU matmul kernel reads every w packed in
    place under one layer index (a layer's q, k and v; gate and up), one kernel call runs them all
    (pallas_kernels/matmul/cpu.py `cpu_matmuls`: one fan-out a layer's attention inputs, not three); so
    does the quantized kernel where every w is a layer of a `QPacked` stack (`qpacked.matmuls`: x quantized
    once for them all)."""
    ws = tuple(ws)
    if not row_tile and len(ws) > 1 and all(
            isinstance(w, LayerOf) and isinstance(w.stack, QPacked) and w.index is ws[0].index for w in ws):
        ys = qpacked.matmuls(x, [w.stack for w in ws], layer=ws[0].index)
        return tuple(y.astype(preferred_element_type or x.dtype) for y in ys)
    one_call = (kernel and not row_tile and len(ws) > 1 and x.dtype == jnp.bfloat16 and all(
        isinstance(w, LayerOf) and isinstance(w.stack, Packed) and w.index is ws[0].index for w in ws))
    if not one_call:
        return tuple(dot(x, w, preferred_element_type, row_tile=row_tile, kernel=kernel) for w in ws)
    ys = cpu_matmul.cpu_matmuls(x, [w.stack.tiles for w in ws], layer=ws[0].index, packed=True, rows=_live(x))
    return tuple(y.astype(preferred_element_type or x.dtype) for y in ys)


def _accumulator(x, out_dtype):
    """The result type a plain product asks for. On XLA CPU a bfloat16 / float16 product asked for in its
    own type is widened to float32 whole (both matrices converted, then a float32 product); asked for a
    float32 result it runs natively (bf16 dot-product units: ~1.8x the float32 rate on this project's
    AVX512-BF16 CPU). So 16-bit products on CPU accumulate in float32 and are rounded after (see also
    runner.step_compiler_options); other backends keep their own choice."""
    if jax.default_backend() == "cpu" and jnp.dtype(x.dtype).itemsize < 4:
        return jnp.float32
    return out_dtype


def take_rows(w, ids, dtype=None):
    """Rows ids [T] of the embedding w [V, D] (plain, a per-row QArray, or packed as the tied head) -> [T, D]
    in the engine dtype."""
    if isinstance(w, QPacked):
        return qpacked.take_rows(w, ids, dtype)
    if isinstance(w, Packed):
        return packed.take_rows(w, ids).astype(dtype or w.dtype)
    if not isinstance(w, QArray):
        return w[ids]
    m = None if w.m is None else w.m[ids]
    return dequantize_parts(w.q[ids].astype(jnp.float32), w.scale[ids], m, w.group, -1).astype(dtype or w.dtype)


def ragged_dot(x, w, group_sizes, group_ids):
    """Grouped product of moe.py: x [M, in] rows sorted by group, w [G, in, out]; group_ids i32[M] is each
    row's group (its expert), which picks the column scales of a QArray (a grouped QArray is dequantized
    whole in x's dtype: the reference path, on every backend)."""
    if not isinstance(w, QArray):
        return jax.lax.ragged_dot(x, w, group_sizes)
    if w.group or w.m is not None:
        return jax.lax.ragged_dot(x, dequantize(w).astype(x.dtype), group_sizes)
    y = jax.lax.ragged_dot(x, w.q.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    return (y * w.scale[:, 0, :][group_ids]).astype(x.dtype)  # scale [G, 1, out] -> [M, out]


def quantize_params(params: dict, fmt: str | None, dtype: str, group: int = 0, symmetric: bool = True) -> dict:
    """The parameter pytree (numpy leaves or QArrays) with its matrices in format `fmt` (None: plain
    arrays of `dtype`; `leaf_format` picks each leaf's format, group and symmetry), converted one leaf at a
    time; other leaves are returned as they are."""
    check_quantization(fmt)

    def conv(path, a):
        axis = leaf_axis(path)
        return a if axis is None else convert_leaf(a, *leaf_format(path, fmt, group, symmetric), axis, dtype)
    return {k: {n: conv((k, n), a) for n, a in v.items()} if k == "layers" else conv((k,), v)
            for k, v in params.items()}


def leaf_format(path: tuple[str, ...], fmt: str | None, group: int,
                symmetric: bool = True) -> tuple[str | None, int, bool]:
    """(format, group, symmetric) of one quantized leaf: the layer matrices take `fmt`, `group` and
    `symmetric`; the embedding and lm_head stay int8, symmetric, in groups of EMBED_GROUP along the hidden
    axis, under int8 and int4: the logits are the products most sensitive to rounding, and groups of 32
    cost an eighth of a byte a weight more than one scale per vocabulary entry for 0.01 - 0.02 less mean
    |delta logprob| on the default model (docs/benchmarks.md, *Quantization and KV cache dtype: quality*)."""
    if fmt in ("int8", "int4") and path in (("embed",), ("lm_head",)):
        return "int8", EMBED_GROUP, True
    return fmt, group, symmetric


def convert_leaf(a, fmt: str | None, group: int, symmetric: bool, axis: int, dtype: str):
    """One leaf (numpy array or QArray) -> the format, group and symmetry asked for (None: a plain array of
    `dtype`)."""
    if isinstance(a, QArray):
        if fmt == a.format and group == a.group and symmetric == (a.m is None):
            return dataclasses.replace(a, dtype=dtype)
        a = dequantize(dataclasses.replace(a, dtype="float32"))
    if fmt is None:
        return np.asarray(a).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype, copy=False)
    return quantize(a, fmt, axis, dtype, group, symmetric=symmetric)


def leaf_axis(path: tuple[str, ...]) -> int | None:
    """The axis a parameter's scales reduce over, by its path in the pytree (None: never quantized)."""
    name = path[-1]
    if path == ("embed",):
        return -1
    if path == ("lm_head",) or (len(path) == 2 and path[0] == "layers" and name in QUANTIZED_LAYER_LEAVES):
        return -2
    return None


def is_quantized_tree(d) -> bool:
    """Whether a restored (orbax) leaf is a saved QArray: a dict of q and scale, with m and form where saved."""
    return isinstance(d, dict) and {"q", "scale"} <= set(d) <= {"q", "scale", "m", "form"}
