"""bfloat16 matrices kept in the CPU matmul kernel's tile order (pallas_kernels/matmul/cpu.py `pack`), so the
kernel reads them without repacking every step: the runner packs its layer matrices and its head so when the
step's products run on the kernel (`pack_layers`, jaxpaged/step/runner.py). A tied embedding [V, D] is packed
as the head [D, V] it also is (`Packed.transposed`): the logits then run on the kernel's tile path instead of
its row-dot path for the transposed form (the default model's head at 64 rows: ~25 % less time, at 1 row
about half), and the token lookup reads its rows out of the tiles (`take_rows`), so the embedding is held once.
`shape` and `dtype` are the matrix's, and `unpack` gives it back exactly, so shape checks, `get_weights` and
`update_weights` see the plain matrix."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import cpu as cpu_matmul

# the stacked layer matrices the runner packs (the quantized ones of jaxpaged/models/quant.py)
LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed:
    """A bfloat16 matrix [.., K, N] as `tiles` [.., N / 16, K / 32, 16, 32] (the kernel's order). `transposed`:
    a tied embedding [V = N, D = K] packed as the head [D, V]; `shape` is then the embedding's [V, D]."""
    tiles: jax.Array
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple:
        t = self.tiles.shape
        k, n = t[-3] * 32, t[-4] * 16
        return (*t[:-4], *((n, k) if self.transposed else (k, n)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.tiles.dtype

    @property
    def sharding(self):
        return self.tiles.sharding

    def unpack(self) -> jax.Array:
        """The matrix this stands for (the embedding [V, D] when `transposed`), exactly."""
        w = cpu_matmul.unpack(self.tiles)
        return w.T if self.transposed else w


def _head_tiles(e):  # embedding [V, D] -> the head's tiles [V / 16, D / 32, 16, 32]
    return cpu_matmul.pack(e.T)


_pack = jax.jit(cpu_matmul.pack)
_pack_owned = jax.jit(cpu_matmul.pack, donate_argnums=0)  # the plain matrix freed as its tiles are made
_pack_head = jax.jit(_head_tiles)
_pack_head_owned = jax.jit(_head_tiles, donate_argnums=0)


def packable(a, ndim: int = 3, transposed: bool = False) -> bool:
    """A plain bfloat16 array of `ndim` dimensions the kernel can take packed: a matrix [.., K, N] (an
    embedding [N, K] when `transposed`) with K % 32 == 0 and N % 16 == 0."""
    if not (isinstance(a, (jax.Array, jax.ShapeDtypeStruct)) and a.ndim == ndim and a.dtype == jnp.bfloat16):
        return False
    k, n = a.shape[-2:][::-1] if transposed else a.shape[-2:]
    return k % 32 == 0 and n % 16 == 0


def pack_layers(params: dict, owned: bool = False) -> dict:
    """The parameters with their stacked plain bfloat16 layer matrices and their head (the lm_head [D, V],
    or the tied embedding [V, D] as the head: `transposed`) `Packed` (shapes only for abstract leaves:
    `jax.ShapeDtypeStruct`s keep their sharding). owned: the plain matrices are the caller's alone and are
    freed as they are packed (never a weight update's arrays: their owner may still use them)."""
    def one(a, ndim=3, transposed=False):
        if not packable(a, ndim, transposed):
            return a
        fn = (_pack_head_owned if owned else _pack_head) if transposed else (_pack_owned if owned else _pack)
        if isinstance(a, jax.ShapeDtypeStruct):
            t = jax.eval_shape(fn, a)
            return Packed(jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=a.sharding), transposed)
        return Packed(fn(a), transposed)
    out = {**params, "layers": {k: one(a) if k in LAYER_MATRICES else a for k, a in params["layers"].items()}}
    if "lm_head" in params:
        out["lm_head"] = one(params["lm_head"], 2)
    else:  # tied: the embedding is the head too
        out["embed"] = one(params["embed"], 2, transposed=True)
    return out


def take_rows(w: Packed, ids):
    """Rows ids [T] of a tied embedding packed as the head (`transposed`) -> [T, D], exactly: row v is
    column v % 16 of tile row v // 16, read out of its D / 32 tiles."""
    nt, kb = w.tiles.shape[-4:-2]
    cols = w.tiles.reshape(nt, kb, 16, 16, 2)  # tile row, k tile, k pair, column, pair half
    return cols[ids // 16, :, :, ids % 16, :].reshape(ids.shape[0], kb * 32)  # [T, kb, 16, 2] -> [T, D]
