"""The device mesh and the one map from parameter paths to PartitionSpecs (tensor parallelism).

A mesh has axes ("data", "model"); one engine (one replica) owns a mesh of shape (1, N), N the tensor
parallel size. Over "model" the attention heads (query and KV) and the MLP columns are split, and so is
the vocabulary of the embedding and the lm_head (when N divides it; replicated otherwise). XLA's SPMD
partitioner inserts the all-reduces after `wo` and `w_down` from these shardings alone; the layers carry
no sharding code. Attention runs per shard through `shard_map` (see `jaxpaged/step/attention.py`).

With fewer KV heads than devices, every KV head is repeated r = N / num_kv_heads times at load (the
columns of wk / wv / bk / bv), so each device holds exactly one KV head; query head h still reads its
original KV head h // (num_heads / num_kv_heads), because consecutive query heads land on the same device
as the copies of their KV head.
"""
from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.config import ModelConfig
from jaxpaged.models.quant import QArray

DATA_AXIS, MODEL_AXIS = "data", "model"
POOL_SPEC = P(None, None, MODEL_AXIS, None)  # k_pool, v_pool [L*N, bs, Hkv, hd]: split by KV head
SCALE_SPEC = P(None, None, MODEL_AXIS)  # quantized pools' scales f32[L*N, bs, Hkv]: split like the pools
REPLICATED = P()


def _devices(devices, need: int, what: str) -> list:
    devices = list(jax.devices() if devices is None else devices)
    if need > len(devices):
        raise ValueError(f"{what} needs {need} devices, but only {len(devices)} are available "
                         f"({jax.default_backend()})")
    return devices


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A ("data", "model") mesh of shape (1, tensor_parallel_size) over the first devices of `devices`
    (default: jax.devices()). ValueError naming the numbers when there are too few devices."""
    devices = _devices(devices, tensor_parallel_size, f"tensor_parallel_size={tensor_parallel_size}")
    grid = np.array(devices[:tensor_parallel_size], dtype=object).reshape(1, tensor_parallel_size)
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS))


def device_groups(tensor_parallel_size: int, data_parallel_size: int, devices: list | None = None) -> list[list]:
    """Replica r gets devices[r*tp:(r+1)*tp]; ValueError when tp * dp exceeds the devices."""
    tp, dp = tensor_parallel_size, data_parallel_size
    devices = _devices(devices, tp * dp, f"tensor_parallel_size={tp} x data_parallel_size={dp}")
    return [devices[r * tp:(r + 1) * tp] for r in range(dp)]


def kv_head_replication(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head tensor parallelism over `tp` devices needs (1: none).

    ValueError when `tp` does not divide the query heads, or the KV heads do not split evenly."""
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
    if Hq % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's num_heads ({Hq})")
    if Hkv >= tp:
        if Hkv % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's num_kv_heads ({Hkv})")
        return 1
    if tp % Hkv:
        raise ValueError(f"with fewer KV heads than devices, tensor_parallel_size ({tp}) must be a "
                         f"multiple of num_kv_heads ({Hkv}) so each KV head is replicated evenly")
    return tp // Hkv


def sharded_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the step sees: num_kv_heads counts the replicated KV heads (>= tp)."""
    r = kv_head_replication(cfg, tp)
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def vocab_sharded(cfg: ModelConfig, tp: int) -> bool:
    return tp > 1 and cfg.vocab_size % tp == 0


def param_partition_specs(cfg: ModelConfig, tp: int) -> dict:
    """PartitionSpec of every parameter (same tree as `weights.param_shapes`) over the "model" axis.

    MoE: expert parallelism — the E axis of the stacked experts is split (each device holds E / tp whole
    experts), the router replicated; XLA all-reduces the expert outputs."""
    ax = MODEL_AXIS
    col, row, rep = P(None, None, ax), P(None, ax, None), P()
    layers = {"attn_norm": rep, "wq": col, "wk": col, "wv": col, "wo": row, "mlp_norm": rep,
              "w_gate": col, "w_up": col, "w_down": row}
    if cfg.num_experts:
        if cfg.num_experts % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the model's num_experts "
                             f"({cfg.num_experts}): experts are split over the devices")
        expert = P(None, ax, None, None)  # [L, E, in, out]
        layers.update(router=rep, w_gate=expert, w_up=expert, w_down=expert)
    if cfg.attention_bias:
        layers.update(bq=P(None, ax), bk=P(None, ax), bv=P(None, ax))
    if cfg.qk_norm:  # per head [L, hd], or over all heads [L, H*hd] (its mean needs the whole row)
        layers.update(q_norm=rep, k_norm=rep)
    if cfg.sandwich_norms:
        layers.update(post_attn_norm=rep, post_mlp_norm=rep)
    vocab = vocab_sharded(cfg, tp)
    specs = {"embed": P(ax, None) if vocab else rep, "final_norm": rep, "layers": layers}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = P(None, ax) if vocab else rep
    return specs


def replicate_kv_heads(params: dict, cfg: ModelConfig, r: int) -> dict:
    """Repeat each KV head's columns of wk / wv (and bk / bv) r times, consecutively (numpy, no copy of
    the other arrays). KV head j becomes heads j*r .. j*r + r-1."""
    if r == 1:
        return params
    hd = cfg.head_dim
    layers = dict(params["layers"])
    for name in ("wk", "wv", "bk", "bv") + (("k_norm",) if cfg.qk_norm == "flat" else ()):
        if name in layers:
            def repeat(a):  # [L, (D,) Hkv*hd]; a QArray's scale [L, 1, Hkv*hd] alike
                heads = a.reshape(a.shape[:-1] + (cfg.num_kv_heads, hd))
                return np.repeat(heads, r, axis=-2).reshape(a.shape[:-1] + (cfg.num_kv_heads * r * hd,))
            layers[name] = jax.tree.map(repeat, layers[name])
    return {**params, "layers": layers}


def place(arr: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    """Place a host array on `mesh` with `spec`; each device reads only its slice (works when the mesh
    spans several processes, each holding the same host array)."""
    return jax.make_array_from_callback(arr.shape, NamedSharding(mesh, spec), lambda idx: arr[idx])


def place_params(params: dict, cfg: ModelConfig, mesh: Mesh) -> dict:
    """Numpy parameter pytree (as loaded) -> sharded device arrays (KV heads replicated as needed)."""
    tp = mesh.shape[MODEL_AXIS]
    params = replicate_kv_heads(params, cfg, kv_head_replication(cfg, tp))
    specs = leaf_specs(param_partition_specs(cfg, tp), params, tp)
    return jax.tree.map(lambda a, s: place(np.asarray(a), mesh, s), params, specs)


def leaf_specs(specs: dict, params: dict, tp: int) -> dict:
    """`param_partition_specs` matched leaf for leaf to `params`: a QArray's q takes its matrix's spec
    and its scale the same spec with None on the scale's size-1 (reduced) axis, so every scale lives
    on the devices holding its columns (or rows, for the embedding). A grouped scale's group axis is split
    with its matrix's rows when its groups divide among the `tp` devices, else replicated (a group then
    spans two devices' rows: XLA's dequantize still sees every scale it needs)."""
    def one(spec, a):
        if not isinstance(a, QArray):
            return spec
        full = tuple(spec) + (None,) * (a.q.ndim - len(spec))
        scale = P(*(None if n == 1 or (ax is not None and n % tp) else ax for n, ax in zip(a.scale.shape, full)))
        return dataclasses.replace(a, q=spec, scale=scale, m=None if a.m is None else scale)
    return jax.tree.map(one, specs, params, is_leaf=lambda x: isinstance(x, P))


def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` (or the older experimental one), without replication checks (named check_vma or
    check_rep, depending on the version): the kernels are opaque to them."""
    if hasattr(jax, "shard_map"):
        sm = jax.shard_map
    else:
        from jax.experimental.shard_map import shard_map as sm
    params = inspect.signature(sm).parameters
    check = {name: False for name in ("check_vma", "check_rep") if name in params}
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)
