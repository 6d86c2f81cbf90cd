"""The one place that picks an attention implementation for the model.

`attention_backend` (EngineConfig) names what the user asks for; `resolve_backend` turns it into one of
`IMPLEMENTATIONS`, from the **devices the step is compiled for** (the mesh), never from
`jax.default_backend()`: a step compiled on a CPU host for an H200 or a TPU topology gets the real kernel.

| asked | CPU target | GPU target (sm_90+ / older) | TPU target |
| --- | --- | --- | --- |
| auto | cpu (vector path: AVX-512 or AVX2), else reference | pallas if shapes fit, else reference | the same |
| pallas | triton (interpret mode) | mosaic_gpu / triton | mosaic_tpu |
| mosaic | error: say mosaic_gpu or mosaic_tpu | mosaic_gpu (sm_90+ only) | mosaic_tpu |
| triton, mosaic_gpu, mosaic_tpu | that kernel in its interpret mode | that kernel (GPU ones only) | mosaic_tpu only |
| cpu | the C++ kernel (error if it cannot be built) | error | error |

`reference`: plain JAX over the paged pool (the oracle of the kernels). `cpu`: the C++ kernel of
pallas_kernels/cpu_ffi.py, reading the pool in place through the XLA FFI, built at first use. The kernels
(pallas_kernels/) run in their interpret mode only when the target is the CPU (tests).

With tensor parallelism the chosen function runs per device through `shard_map`: each device attends
its own query heads over its own KV heads (q and the pools split on their head axes, the block tables
and lengths replicated), so the kernels stay single-device code and no K/V crosses devices.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpaged.config import ATTENTION_BACKENDS
from jaxpaged.step.mesh import MODEL_AXIS, POOL_SPEC, SCALE_SPEC, shard_map
from pallas_kernels import cpu_ffi
from pallas_kernels.reference import ragged_paged_attention_reference

IMPLEMENTATIONS = ("reference", "cpu", "triton", "mosaic_gpu", "mosaic_tpu")
_PLATFORM_OF = {"triton": "gpu", "mosaic_gpu": "gpu", "mosaic_tpu": "tpu"}


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def target_platform(devices) -> tuple[str, float | None]:
    """('cpu' | 'gpu' | 'tpu', CUDA compute capability or None) of the devices a step is compiled for
    (real devices or compile-only topology devices alike)."""
    d = list(devices)[0]
    platform = d.platform.lower()
    if platform in ("cuda", "rocm", "gpu"):
        cc = getattr(d, "compute_capability", None)
        return "gpu", float(cc) if cc else _capability_from_kind(d.device_kind)
    return ("tpu" if platform == "tpu" else "cpu"), None


def _capability_from_kind(kind: str) -> float | None:
    """Compute capability from the device kind's name, for devices that do not report it."""
    for names, cc in ((("B200", "B100", "GB200"), 10.0), (("H100", "H200", "H800", "GH200", "H20"), 9.0),
                      (("L4", "L40", "RTX 40"), 8.9), (("A100", "A800", "A30", "A10"), 8.0)):
        if any(n in kind for n in names):
            return cc
    return None


def resolve_backend(name: str, head_dim: int, block_size: int, devices=None) -> str:
    """The implementation (one of IMPLEMENTATIONS) for `attention_backend=name` on `devices` (default:
    jax.devices()); ValueError naming the backend and the reason when it cannot run there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    platform, cc = target_platform(jax.devices() if devices is None else devices)
    fits = _pow2(block_size) and _pow2(head_dim) and 16 <= head_dim <= 256
    hopper = cc is not None and cc >= 9.0
    if name == "auto":  # on CPU targets the C++ kernel where it has its AVX-512 path (docs/kernels.md)
        if platform == "cpu":
            name = "cpu" if cpu_ffi.vectorized() else "reference"
        else:
            name = "pallas" if fits and _pallas_for(platform, hopper) else "reference"
    if name == "reference":
        return name
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on CPU targets, not {platform}")
        if not cpu_ffi.available():
            raise ValueError("attention_backend='cpu': the C++ kernel could not be built here (see the log); "
                             "use 'reference'")
        return name
    if not fits:
        raise ValueError(f"attention_backend={name!r} needs a power-of-two block_size and head_dim in "
                         f"16..256 (got block_size {block_size}, head_dim {head_dim})")
    if name == "pallas":
        impl = _pallas_for(platform, hopper)
        if impl is None:
            raise ValueError(f"attention_backend='pallas': no Pallas kernel is registered for {platform} "
                             f"targets; use 'reference'")
        return impl
    if name == "mosaic":
        if platform == "cpu":
            raise ValueError("attention_backend='mosaic' is ambiguous on a CPU target (interpret mode): "
                             "say 'mosaic_gpu' or 'mosaic_tpu'")
        name = "mosaic_gpu" if platform == "gpu" else "mosaic_tpu"
    if name not in KERNELS:
        raise ValueError(f"attention_backend={name!r}: that kernel is not available in this build")
    if platform != "cpu" and _PLATFORM_OF[name] != platform:
        raise ValueError(f"attention_backend={name!r} runs on {_PLATFORM_OF[name]} targets, not {platform}")
    if name == "mosaic_gpu" and platform == "gpu" and not hopper:
        raise ValueError(f"attention_backend='mosaic_gpu' needs sm_90 or newer (Hopper); this GPU is "
                         f"sm_{int(10 * cc) if cc else '?'}: use 'triton'")
    return name


def _pallas_for(platform: str, hopper: bool) -> str | None:
    """What 'pallas' means on a platform: Mosaic GPU on Hopper and newer, Triton below (and in CPU
    interpret mode), Mosaic TPU on TPUs — None when that kernel is not registered."""
    if platform == "tpu":
        want = ("mosaic_tpu",)
    elif platform == "gpu" and hopper:
        want = ("mosaic_gpu", "triton")
    else:
        want = ("triton",)
    return next((w for w in want if w in KERNELS), None)


def make_attention(backend: str, decode_only: bool, mesh=None):
    """attn(q [T,Hq,hd], k_pool, v_pool, block_tables [S,B], seq_lens [S], query_start_loc [S+1], **options);
    options (keyword-only, static): scale, window, softcap — forwarded to the implementation as given;
    and for quantized pools the arrays k_scale, v_scale f32[num_blocks, bs, Hkv] (split like the pools).

    With a `mesh` whose "model" axis has more than one device, the function runs per head shard. The
    kernels run in interpret mode when the mesh's devices are CPUs."""
    devices = jax.devices() if mesh is None else mesh.devices.flat
    if backend == "reference":
        attn = ragged_paged_attention_reference
    elif backend == "cpu":
        attn = cpu_ffi.cpu_ragged_paged_attention
    else:
        attn = KERNELS[backend](decode_only, target_platform(devices)[0] == "cpu")
    return shard_heads(attn, mesh)


def shard_heads(attn, mesh=None):
    """`attn` (the reference's signature) per device of the mesh's "model" axis: each attends its own
    query heads over its own KV heads (as is, without a mesh or with one model device)."""
    if mesh is None or mesh.shape[MODEL_AXIS] == 1:
        return attn
    heads = P(None, MODEL_AXIS, None)  # q, out [T, Hq, hd]

    def sharded(q, k_pool, v_pool, *rest, k_scale=None, v_scale=None, **options):
        # rest (tables, lengths, ...) replicated; scale pools (if any) split by KV head like the pools
        scales = () if k_scale is None else (k_scale, v_scale)

        def local(q, k_pool, v_pool, *args):
            n = len(args) - len(scales)
            kw = dict(zip(("k_scale", "v_scale"), args[n:]))
            return attn(q, k_pool, v_pool, *args[:n], **kw, **options)
        f = shard_map(local, mesh, in_specs=(heads, POOL_SPEC, POOL_SPEC) + (P(),) * len(rest)
                      + (SCALE_SPEC,) * len(scales), out_specs=heads)
        return f(q, k_pool, v_pool, *rest, *scales)
    return sharded


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
    from pallas_kernels import paged_attention, ragged_paged_attention
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
    from pallas_kernels.mosaic_gpu_common import FLOATS, ROWS
    from pallas_kernels.mosaic_gpu_decode import mosaic_paged_attention
    from pallas_kernels.mosaic_gpu_ragged import mosaic_ragged_paged_attention
    fallback = _triton(decode_only, interpret)
    mosaic = _decode_rows(mosaic_paged_attention) if decode_only else mosaic_ragged_paged_attention

    def attn(q, k_pool, v_pool, *rest, **options):
        fits = (jnp.dtype(q.dtype) in FLOATS and k_pool.dtype != jnp.float32 and k_pool.shape[1] >= 8
                and (decode_only or q.shape[1] // k_pool.shape[2] <= ROWS))
        return (mosaic if fits else fallback)(q, k_pool, v_pool, *rest, **options)
    return attn


def _mosaic_tpu(decode_only: bool, interpret: bool):
    """The Pallas Mosaic TPU kernel: one ragged kernel for decode-only and mixed steps alike (a decode-only
    step is a ragged one of one row a slot; the kernel's tiles follow from T <= S)."""
    from pallas_kernels.mosaic_tpu_ragged import mosaic_tpu_ragged_paged_attention
    return functools.partial(mosaic_tpu_ragged_paged_attention, interpret=interpret)


# implementation name -> factory(decode_only, interpret) -> attention function with make_attention's signature
KERNELS = {"triton": _triton, "mosaic_gpu": _mosaic_gpu, "mosaic_tpu": _mosaic_tpu}
# the implementations with a decode kernel of their own: the engine compiles decode-only step variants for
# them (Mosaic TPU's one ragged kernel serves decode steps too, so a second variant would be the same program)
DECODE_KERNELS = ("triton", "mosaic_gpu")
