"""The paged-attention implementations, in the order `attention_backend="auto"` prefers them, each with
what it supports: the targets it compiles for, the query and KV-pool dtypes (int8 / float8_e4m3fn pools
carry scales), the block sizes and head dims, and how to build the engine's attention function from it.

Every implementation takes the ragged contract of `reference.ragged_paged_attention_reference` (options
scale, window and softcap included, which all of them support). The engine's resolver
(jaxpaged/step/attention.py `resolve_backend`) walks `BACKENDS`: "auto" takes the first that runs natively
on the target, supports the step's shapes and dtypes and is not passed over for speed (`auto_skip`), the
reference last; a name asked for explicitly that cannot run raises the reason `unsupported` gives.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax.numpy as jnp

from pallas_kernels.attention import cpu
from pallas_kernels.attention.api import FLOATS, QUANTIZED
from pallas_kernels.attention.reference import ragged_paged_attention_reference

ANY_DTYPE = None  # a dtype limit that accepts every dtype


@dataclasses.dataclass(frozen=True)
class Config:
    """What an implementation is asked to run: the target and the step's attention shapes and dtypes."""
    platform: str                # 'cpu' | 'gpu' | 'tpu': the devices the step is compiled for
    capability: float | None     # CUDA compute capability of a GPU target
    head_dim: int
    block_size: int
    q_dtype: jnp.dtype | None    # the model's dtype (None: not checked)
    pool_dtype: jnp.dtype | None  # the KV pool's storage dtype (kv_cache_dtype, or dtype when 'auto'); None: unchecked


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _names(dtypes) -> str:
    return " / ".join(d.name for d in dtypes)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation and its limits."""
    name: str
    platforms: tuple[str, ...]   # targets it compiles for
    interpret: bool              # also runs on CPU targets in Pallas interpret mode (tests)
    pallas: bool                 # a Pallas kernel: a candidate of attention_backend='pallas'
    q_dtypes: tuple | None
    pool_dtypes: tuple | None
    shapes: Callable[[int, int], bool]  # (head_dim, block_size) -> supported
    shapes_text: str             # the shape limit in words
    make: Callable               # (decode_only, interpret) -> attn(q, k_pool, v_pool, tables, lens, qsl, **options)
    min_capability: float | None = None  # GPU targets: the oldest CUDA compute capability
    decode_kernel: bool = False  # has a decode kernel of its own: the engine compiles decode-only step variants
    available: Callable[[], bool] = lambda: True  # built / importable here
    auto_skip: Callable[[Config], str | None] = lambda cfg: None  # why "auto" passes it over though it runs

    def unsupported(self, cfg: Config) -> str | None:
        """Why this implementation cannot run `cfg` (naming the argument and the limit); None when it can."""
        if cfg.platform not in self.platforms and not (cfg.platform == "cpu" and self.interpret):
            return f"runs on {' / '.join(self.platforms)} targets, not {cfg.platform}"
        if cfg.platform == "gpu" and self.min_capability and (cfg.capability or 0) < self.min_capability:
            have = f"sm_{int(10 * cfg.capability)}" if cfg.capability else "of unknown capability"
            return f"needs sm_{int(10 * self.min_capability)} or newer (Hopper); this GPU is {have}: use 'triton'"
        if not self.shapes(cfg.head_dim, cfg.block_size):
            return f"needs {self.shapes_text} (got block_size {cfg.block_size}, head_dim {cfg.head_dim})"
        if self.q_dtypes is not ANY_DTYPE and cfg.q_dtype is not None and cfg.q_dtype not in self.q_dtypes:
            return f"computes in {_names(self.q_dtypes)}, not dtype {cfg.q_dtype.name}"
        if self.pool_dtypes is not ANY_DTYPE and cfg.pool_dtype is not None and cfg.pool_dtype not in self.pool_dtypes:
            return (f"reads KV pools of {_names(self.pool_dtypes)}, not {cfg.pool_dtype.name} (kv_cache_dtype, "
                    f"or dtype when kv_cache_dtype is 'auto'): use 'reference'")
        if not self.available():
            return "could not be built here (see the log): use 'reference'"
        return None


def _decode_rows(paged):
    """The decode-only step's attention from a decode kernel `paged(q [S, Hq, hd], k_pool, v_pool, tables,
    lens, **options)`: slot i's single query is row query_start_loc[i] (empty slots: seq_lens 0)."""
    def decode(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, **options):
        S, T = seq_lens.shape[0], q.shape[0]
        rows = jnp.minimum(query_start_loc[:S], T - 1)
        out = paged(q[rows], k_pool, v_pool, block_tables, seq_lens, **options)
        slot_of_row = jnp.searchsorted(query_start_loc[1:], jnp.arange(T), side="right")
        valid = jnp.arange(T) < query_start_loc[S]
        return jnp.where(valid[:, None, None], out[jnp.minimum(slot_of_row, S - 1)], 0).astype(q.dtype)
    return decode


def _triton(decode_only: bool, interpret: bool):
    """The Pallas Triton kernels: the decode kernel for decode-only steps, the ragged kernel otherwise."""
    from pallas_kernels.attention.triton_decode import paged_attention
    from pallas_kernels.attention.triton_ragged import ragged_paged_attention
    kernel = paged_attention if decode_only else ragged_paged_attention
    attn = functools.partial(kernel, interpret=interpret)
    return _decode_rows(attn) if decode_only else attn


def _mosaic_gpu(decode_only: bool, interpret: bool):
    """The Mosaic GPU kernels (Hopper, sm_90a): TMA and WGMMA. WGMMA multiplies 16-bit (and 8-bit)
    values, so a float32 model or pool, a block_size under 8 or (ragged) a GQA group over 64 takes the
    Triton kernels instead, chosen per call from the shapes. JAX 0.10's Mosaic GPU interpret mode cannot
    run a construct the kernels use (a transposed WGMMA operand; docs/kernels.md), so a CPU target is
    refused: 'triton' or 'reference' run there."""
    if interpret:
        raise ValueError("attention_backend='mosaic_gpu' cannot run on a CPU target: Mosaic GPU's interpret "
                         "mode in this JAX cannot run the kernels' transposed WGMMA operand; use 'triton' "
                         "(interpret mode) or 'reference'")
    from pallas_kernels.attention.mosaic_gpu_common import FLOATS as WGMMA_FLOATS
    from pallas_kernels.attention.mosaic_gpu_common import ROWS
    from pallas_kernels.attention.mosaic_gpu_decode import mosaic_paged_attention
    from pallas_kernels.attention.mosaic_gpu_ragged import mosaic_ragged_paged_attention
    fallback = _triton(decode_only, interpret)
    mosaic = _decode_rows(mosaic_paged_attention) if decode_only else mosaic_ragged_paged_attention

    def attn(q, k_pool, v_pool, *rest, **options):
        fits = (jnp.dtype(q.dtype) in WGMMA_FLOATS and k_pool.dtype != jnp.float32 and k_pool.shape[1] >= 8
                and (decode_only or q.shape[1] // k_pool.shape[2] <= ROWS))
        return (mosaic if fits else fallback)(q, k_pool, v_pool, *rest, **options)
    return attn


def _mosaic_tpu(decode_only: bool, interpret: bool):
    """The Pallas Mosaic TPU kernel: one ragged kernel for decode-only and mixed steps alike (a decode-only
    step is a ragged one of one row a slot; the kernel's tiles follow from T <= S)."""
    from pallas_kernels.attention.mosaic_tpu import mosaic_tpu_ragged_paged_attention
    return functools.partial(mosaic_tpu_ragged_paged_attention, interpret=interpret)


def _cpu_skip(cfg: Config) -> str | None:
    """The C++ kernel is slower than the reference without its vector path (AVX-512 or AVX2 + FMA), which
    takes blocks of at most cpu.VECTOR_BLOCK_SIZE (docs/kernels.md)."""
    if not cpu.vectorized():
        return "the C++ kernel has only its plain-loop path here (slower than the reference)"
    if cfg.block_size > cpu.VECTOR_BLOCK_SIZE:
        return f"block_size {cfg.block_size} > {cpu.VECTOR_BLOCK_SIZE} runs the C++ kernel's plain-loop path"
    return None


def _triton_shapes(head_dim: int, block_size: int) -> bool:
    return _pow2(block_size) and _pow2(head_dim) and 16 <= head_dim <= 256


_TRITON_SHAPES = "a power-of-two block_size and a power-of-two head_dim in 16..256"
_POOLS = FLOATS + QUANTIZED

BACKENDS = {b.name: b for b in (
    Backend("mosaic_tpu", ("tpu",), True, True, q_dtypes=FLOATS[:2], pool_dtypes=FLOATS[:2] + QUANTIZED,
            shapes=lambda hd, bs: hd in (64, 128, 256) and bs > 0 and bs % 8 == 0,
            shapes_text="block_size a multiple of 8 and head_dim 64, 128 or 256", make=_mosaic_tpu),
    # float32 (or a block_size under 8, a GQA group over 64) runs its Triton fallback: Triton's limits
    Backend("mosaic_gpu", ("gpu",), True, True, q_dtypes=FLOATS, pool_dtypes=_POOLS, shapes=_triton_shapes,
            shapes_text=_TRITON_SHAPES, make=_mosaic_gpu, min_capability=9.0, decode_kernel=True),
    Backend("triton", ("gpu",), True, True, q_dtypes=FLOATS, pool_dtypes=_POOLS, shapes=_triton_shapes,
            shapes_text=_TRITON_SHAPES, make=_triton, decode_kernel=True),
    Backend("cpu", ("cpu",), False, False, q_dtypes=FLOATS, pool_dtypes=cpu.POOL_DTYPES,
            shapes=lambda hd, bs: hd > 0 and bs > 0, shapes_text="positive sizes",
            make=lambda decode_only, interpret: cpu.cpu_ragged_paged_attention, available=cpu.available,
            auto_skip=_cpu_skip),
    Backend("reference", ("cpu", "gpu", "tpu"), False, False, q_dtypes=ANY_DTYPE, pool_dtypes=ANY_DTYPE,
            shapes=lambda hd, bs: hd > 0 and bs > 0, shapes_text="positive sizes",
            make=lambda decode_only, interpret: ragged_paged_attention_reference),
)}
PALLAS_ON_CPU = "triton"  # what attention_backend='pallas' runs on a CPU target (interpret mode)
DECODE_KERNELS = tuple(name for name, b in BACKENDS.items() if b.decode_kernel)
