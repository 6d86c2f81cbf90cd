"""Adapter slots on the device, an LRU host cache behind them, and the per-token slot index.

Device arrays (every target leaf t of `peft.lora_targets`; NS = max_loras + 1, R = max_lora_rank):
    a[t] [L, NS, in, R], b[t] [L, NS, R, out]; slot 0 all zeros (the base model).
They enter the step beside the parameters (`params["lora"]`), so loading, evicting and replacing an
adapter is a write into them (one small jitted update, compiled once, the arrays donated): the step
never recompiles. With tensor parallelism a and b split like their base weight: for column-parallel
targets (q/k/v/gate/up, out split) b's out axis, for row-parallel ones (o/down, in split) a's in axis;
KV heads repeated for wk / wv exactly as the base's (mesh.replicate_kv_heads).

Registered adapters (`add`) are loaded and checked at once into the host cache (LRU, `max_cpu_loras`
adapters; adapters changed by `update` stay pinned there, their weights being on no disk). `token_index`
puts each adapter of a step into a device slot (LRU eviction among the others) and returns the step's
per-token slot indices. The scheduler admits at most `max_loras` distinct adapters into the running set,
so a step's adapters always fit.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.checkpoints.weights import param_shapes
from jaxpaged.config import ModelConfig
from jaxpaged.lora.peft import HostAdapter, host_adapter, load_peft, lora_targets
from jaxpaged.lora.request import LoRARequest
from jaxpaged.step.mesh import MODEL_AXIS, kv_head_replication

_ROW_PARALLEL = ("wo", "w_down")


def slot_specs(targets, tp: int) -> dict:
    """PartitionSpecs of the slot arrays ({"a": {t: ...}, "b": {t: ...}}), split like the base weights."""
    ax = MODEL_AXIS if tp > 1 else None
    return {"a": {t: P(None, None, ax, None) if t in _ROW_PARALLEL else P() for t in targets},
            "b": {t: P() if t in _ROW_PARALLEL else P(None, None, None, ax) for t in targets}}


class LoRASlots:
    """The adapters of one engine: registry, host cache, device slots (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 dtype: str, mesh, abstract: bool = False):
        self.cfg, self.dtype, self.mesh = cfg, dtype, mesh
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        tp = mesh.shape[MODEL_AXIS]
        self.kv_repeat = kv_head_replication(cfg, tp)
        self.targets = lora_targets(cfg)
        shapes, NS, R = param_shapes(cfg)["layers"], max_loras + 1, max_lora_rank
        L = cfg.num_layers
        out = {t: shapes[t][-1] * (self.kv_repeat if t in ("wk", "wv") else 1) for t in self.targets}
        dt = jnp.dtype(dtype)
        abstract_arrays = {"a": {t: jax.ShapeDtypeStruct((L, NS, shapes[t][-2], R), dt) for t in self.targets},
                           "b": {t: jax.ShapeDtypeStruct((L, NS, R, out[t]), dt) for t in self.targets}}
        specs = slot_specs(self.targets, tp)
        self.shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        if abstract:
            self.arrays = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                       abstract_arrays, self.shardings)
        else:
            self.arrays = jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_arrays),
                                  out_shardings=self.shardings)()
        one = jax.tree.map(lambda s: NamedSharding(mesh, P(*(s[:1] + s[2:]))), specs,
                           is_leaf=lambda x: isinstance(x, P))  # one slot's [L, ...]: the slot axis dropped
        self._write = jax.jit(lambda arrays, slot, new: jax.tree.map(lambda x, n: x.at[:, slot].set(n), arrays, new),
                              donate_argnums=0, in_shardings=(self.shardings, None, one),
                              out_shardings=self.shardings)
        self.registered: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()  # LRU: the last is the newest
        self.pinned: set[int] = set()                             # updated in memory: never dropped
        self.device: OrderedDict[int, int] = OrderedDict()        # lora_int_id -> slot, LRU
        self.free_slots = list(range(max_loras, 0, -1))
        self.num_loads = self.num_evictions = 0
        self.load_seconds = 0.0

    # -- registry -------------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> bool:
        """Register and load (checked now: ValueError naming what is wrong) an adapter; False if it is
        registered already."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        old = self.registered.get(lora.lora_int_id)
        if old is not None:
            if old != lora:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already registered as {old.lora_name!r} "
                                 f"({old.lora_path}); remove it first")
            return False
        for other in self.registered.values():
            if other.lora_name == lora.lora_name:
                raise ValueError(f"lora_name {lora.lora_name!r} is already registered with lora_int_id "
                                 f"{other.lora_int_id}")
        self._cache(lora.lora_int_id, self._load(lora))
        self.registered[lora.lora_int_id] = lora
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot and host copy); False if it was not registered."""
        if self.registered.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        self.pinned.discard(lora_int_id)
        slot = self.device.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return True

    def update(self, lora_int_id: int, weights) -> None:
        """Replace a registered adapter's A/B (PEFT-named (name, array) pairs or a dict of them, scaled by
        its config; or {"a": {leaf: [L, in, r]}, "b": {leaf: [L, r, out]}} with scaling in b, r <=
        max_lora_rank): host cache and, when resident, its device slot. ValueError names what is wrong."""
        if lora_int_id not in self.registered:
            raise ValueError(f"update_lora: lora_int_id {lora_int_id} is not registered")
        cur = self._host(lora_int_id)
        if isinstance(weights, dict) and set(weights) == {"a", "b"}:
            new = self._from_pytree(weights, cur)
        else:
            pairs = weights.items() if isinstance(weights, dict) else weights
            new = host_adapter(self.cfg, ((n, np.asarray(x)) for n, x in pairs), cur.rank, cur.scaling,
                               self.max_lora_rank, self.dtype, "update_lora")
        self._cache(lora_int_id, new)
        self.pinned.add(lora_int_id)
        if lora_int_id in self.device:
            self._put(self.device[lora_int_id], new)

    def _from_pytree(self, weights: dict, cur: HostAdapter) -> HostAdapter:
        """The slot-layout pytree, padded to max_lora_rank; rank and scaling stay the adapter's config's."""
        shapes, L, R = param_shapes(self.cfg)["layers"], self.cfg.num_layers, self.max_lora_rank
        out = {"a": {}, "b": {}}
        for which in ("a", "b"):
            unknown = sorted(set(weights[which]) - set(self.targets))
            if unknown:
                raise ValueError(f"update_lora: unknown targets {unknown} (the model's: {list(self.targets)})")
            for t in self.targets:
                d_in, d_out = shapes[t][-2], shapes[t][-1]
                full = np.zeros((L, d_in, R) if which == "a" else (L, R, d_out), np.float32)
                if t in weights[which]:
                    x = np.asarray(weights[which][t], np.float32)
                    r = x.shape[-1] if which == "a" else x.shape[1] if x.ndim == 3 else -1
                    if not (0 < r <= R and x.shape == ((L, d_in, r) if which == "a" else (L, r, d_out))):
                        raise ValueError(f"update_lora: {which}[{t!r}] has shape {list(x.shape)}, needs "
                                         f"{[L, d_in, 'r'] if which == 'a' else [L, 'r', d_out]} with r <= "
                                         f"max_lora_rank ({R})")
                    full[(slice(None), slice(None), slice(0, r)) if which == "a" else (slice(None), slice(0, r))] = x
                out[which][t] = full.astype(jnp.dtype(self.dtype))
        return HostAdapter(out["a"], out["b"], cur.scaling, cur.rank)

    def _load(self, lora: LoRARequest) -> HostAdapter:
        t0 = time.perf_counter()
        adapter = load_peft(lora.lora_path, self.cfg, self.max_lora_rank, self.dtype)
        self.load_seconds += time.perf_counter() - t0
        self.num_loads += 1
        return adapter

    def _cache(self, lora_int_id: int, adapter: HostAdapter) -> None:
        self.host[lora_int_id] = adapter
        self.host.move_to_end(lora_int_id)
        for old in [i for i in self.host if i not in self.pinned][:max(0, len(self.host) - self.max_cpu_loras)]:
            del self.host[old]

    def _host(self, lora_int_id: int) -> HostAdapter:
        if lora_int_id not in self.host:  # dropped from the host cache: read again from its directory
            self._cache(lora_int_id, self._load(self.registered[lora_int_id]))
        self.host.move_to_end(lora_int_id)
        return self.host[lora_int_id]

    # -- device slots ---------------------------------------------------------------------
    def _put(self, slot: int, adapter: HostAdapter) -> None:
        """Write an adapter into device slot `slot` (KV heads of wk / wv repeated like the base's)."""
        r, hd = self.kv_repeat, self.cfg.head_dim
        b = dict(adapter.b)
        for t in ("wk", "wv"):
            if r > 1:
                x = b[t]  # [L, R, Hkv*hd]
                b[t] = np.repeat(x.reshape(x.shape[:-1] + (-1, hd)), r, axis=-2).reshape(x.shape[:-1] + (-1,))
        self.arrays = self._write(self.arrays, np.int32(slot), {"a": adapter.a, "b": b})

    def slot(self, lora_int_id: int, keep=()) -> int:
        """The device slot holding the adapter, loading it (evicting the least recently used adapter not
        in `keep`) when it is not resident."""
        if lora_int_id in self.device:
            self.device.move_to_end(lora_int_id)
            return self.device[lora_int_id]
        if not self.free_slots:
            victim = next(i for i in self.device if i not in keep)
            self.free_slots.append(self.device.pop(victim))
            self.num_evictions += 1
        s = self.free_slots.pop()
        self._put(s, self._host(lora_int_id))
        self.device[lora_int_id] = s
        return s

    def token_index(self, scheduled, T: int) -> np.ndarray:
        """i32[T]: each scheduled token's adapter slot (0: the base model, and the padding)."""
        ids = [req.lora_int_id for req, _ in scheduled]
        wanted = {i for i in ids if i}
        slots = {i: self.slot(i, wanted) for i in wanted} | {0: 0}
        out = np.zeros(T, np.int32)
        n = sum(c for _, c in scheduled)
        out[:n] = np.repeat(np.array([slots[i] for i in ids], np.int32), [c for _, c in scheduled])
        return out

    def stats(self) -> dict:
        return dict(lora_registered=len(self.registered), lora_on_device=len(self.device),
                    lora_in_host_cache=len(self.host), lora_loads=self.num_loads,
                    lora_evictions=self.num_evictions, lora_load_seconds=self.load_seconds)
