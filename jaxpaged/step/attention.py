"""The one place that picks an attention implementation for the model.

`attention_backend` (EngineConfig) names what the user asks for; `resolve_backend` turns it into one of the
implementations of pallas_kernels/attention/backends.py (`BACKENDS`, each declaring the targets,
dtypes, KV cache dtypes, block sizes and head dims it supports), from the **devices the step is compiled
for** (the mesh), never from `jax.default_backend()`: a step compiled on a CPU host for an H200 or a TPU
topology gets the real kernel.

| asked | CPU target | GPU target (sm_90+ / older) | TPU target |
| --- | --- | --- | --- |
| auto | cpu (vector path, block_size <= 128, f32 / bf16 KV), else reference | pallas if it fits, else ref. | the same |
| pallas | triton (interpret mode) | mosaic_gpu / triton | mosaic_tpu |
| mosaic | error: say mosaic_gpu or mosaic_tpu | mosaic_gpu (sm_90+ only) | mosaic_tpu |
| triton, mosaic_gpu, mosaic_tpu | that kernel in its interpret mode | that kernel (GPU ones only) | mosaic_tpu only |
| cpu | the C++ kernel (error if it cannot be built) | error | error |

"auto" never names an implementation that would run the reference under its own name (the C++ kernel
on an int8 / fp8 KV cache resolves to "reference"); a name asked for explicitly that does not support
the step raises a ValueError naming the argument and the limit. The kernels run in their interpret mode
only when the target is the CPU (tests).

With tensor parallelism the chosen function runs per device through `shard_map`: each device attends
its own query heads over its own KV heads (q and the pools split on their head axes, the block tables
and lengths replicated), so the kernels stay single-device code and no K/V crosses devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpaged.config import ATTENTION_BACKENDS
from jaxpaged.step import kv_cache
from jaxpaged.step.mesh import MODEL_AXIS, POOL_SPEC, SCALE_SPEC, shard_map
from pallas_kernels.attention.backends import BACKENDS, DECODE_KERNELS, PALLAS_ON_CPU, Config

__all__ = ["DECODE_KERNELS", "make_attention", "resolve_backend", "shard_heads", "target_platform"]


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


def resolve_backend(name: str, head_dim: int, block_size: int, devices=None, *, dtype=None,
                    kv_cache_dtype: str = "auto") -> str:
    """The implementation (a name of BACKENDS) for `attention_backend=name` on `devices` (default:
    jax.devices()) for a model of `dtype` (None: not checked) whose KV cache is stored as `kv_cache_dtype`;
    ValueError naming the backend and the reason when it cannot run there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    platform, cc = target_platform(jax.devices() if devices is None else devices)
    known = dtype is not None or kv_cache_dtype != "auto"  # the pool's storage dtype follows from these
    pool = kv_cache.storage_dtype(kv_cache_dtype, dtype) if known else None
    cfg = Config(platform, cc, head_dim, block_size, None if dtype is None else jnp.dtype(dtype), pool)
    if name == "auto":  # the first that runs natively here and is not passed over for speed; the reference last
        return next(b.name for b in BACKENDS.values() if platform in b.platforms and b.unsupported(cfg) is None
                    and b.auto_skip(cfg) is None)
    if name == "pallas":
        # the first Pallas kernel for the target (and its GPU's capability); then its limits are checked
        name = PALLAS_ON_CPU if platform == "cpu" else next(
            (b.name for b in BACKENDS.values() if b.pallas and platform in b.platforms
             and (cc or 0) >= (b.min_capability or 0)), None)
        if name is None:
            raise ValueError(f"attention_backend='pallas': no Pallas kernel is registered for {platform} "
                             f"targets; use 'reference'")
    elif name == "mosaic":
        if platform == "cpu":
            raise ValueError("attention_backend='mosaic' is ambiguous on a CPU target (interpret mode): "
                             "say 'mosaic_gpu' or 'mosaic_tpu'")
        name = "mosaic_gpu" if platform == "gpu" else "mosaic_tpu"
    reason = BACKENDS[name].unsupported(cfg)
    if reason:
        raise ValueError(f"attention_backend={name!r} {reason}")
    return name


def make_attention(backend: str, decode_only: bool, mesh=None):
    """attn(q [T,Hq,hd], k_pool, v_pool, block_tables [S,B], seq_lens [S], query_start_loc [S+1], **options);
    options (keyword-only, static): scale, window, softcap — forwarded to the implementation as given;
    and for quantized pools the arrays k_scale, v_scale f32[num_blocks, bs, Hkv] (split like the pools).

    With a `mesh` whose "model" axis has more than one device, the function runs per head shard. The
    kernels run in interpret mode when the mesh's devices are CPUs."""
    devices = jax.devices() if mesh is None else mesh.devices.flat
    attn = BACKENDS[backend].make(decode_only, target_platform(devices)[0] == "cpu")
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
