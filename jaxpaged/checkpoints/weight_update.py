"""In-process weight updates (`LLM.update_weights`, `LLM.get_weights`): new values for the runner's
parameter arrays, same shapes, dtypes and shardings, so the compiled steps run on as they are.

Two inputs (docs/research.md):
- (Hugging Face tensor name, array) pairs, as vLLM's `load_weights` takes them: mapped by the family's
  name map (`weights.map_named_tensors`: transposes, Phi-3's fused rows, stacking over layers and
  experts); any subset of the checkpoint's tensors. A stacked parameter receives the layers given, in one
  scatter on the device (or one placement when every layer is given).
- (part of) the engine's own pytree, as `get_weights` returns it: device arrays with the right sharding
  are adopted as they are, other device arrays are copied device to device, numpy arrays placed.
Everything is checked before anything changes (ValueError naming the tensor); then the runner's params
are replaced and the prefix cache is flushed (its blocks hold K/V of the old weights). Requests must not
be running: the update is refused (RuntimeError) while the engine has unfinished requests, unless it is
paused (`pause_generation`, not still draining): then the kept requests are sent back to recompute their
KV under the new weights when generation resumes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxpaged.checkpoints.weights import NP_DTYPES, map_named_tensors
from jaxpaged.controls.kv import invalidate_kv
from jaxpaged.models.qarray import QArray, dequantize, quantize
from jaxpaged.models.qpacked import QPacked
from jaxpaged.models.quant import Packed
from jaxpaged.step.mesh import kv_head_replication, replicate_kv_heads


def _put(arr: np.ndarray, sharding) -> jax.Array:
    """Host array -> device array of `sharding` (each device reads its slice)."""
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


@functools.lru_cache(maxsize=None)
def _scatter(sharding):
    """Jitted `a.at[rows].set(values)` whose output keeps `sharding`."""
    return jax.jit(lambda a, rows, values: a.at[rows].set(values), out_shardings=sharding)


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _check_leaf(name: str, value, current) -> None:
    shape, dtype = tuple(np.shape(value)), getattr(value, "dtype", None)
    if shape != current.shape or dtype != current.dtype:
        raise ValueError(f"update_weights: tensor {name!r} has shape {shape} and dtype {dtype}, the engine's "
                         f"is {current.shape} {current.dtype}")


def _from_pytree(engine, weights: dict) -> dict:
    """{path: new device array} for a (partial) pytree of the engine's layout."""
    current = dict(jax.tree_util.tree_flatten_with_path(engine.runner.params, is_leaf=_packed)[0])
    new = {}
    for path, value in jax.tree_util.tree_flatten_with_path(weights)[0]:
        name = _path_name(path)
        if path not in current:
            raise ValueError(f"update_weights: unknown parameter {name!r}; the engine's are "
                             f"{', '.join(sorted(_path_name(p) for p in current))}")
        _check_leaf(name, value, current[path])
        if isinstance(current[path], (QArray, QPacked)):  # plain values, quantized as at load
            new[path] = _quantized_leaf(current[path], np.asarray(value), name)
            continue
        sharding = current[path].sharding
        if isinstance(value, jax.Array):  # on the right devices with the right sharding: adopted as is
            new[path] = value if value.sharding.is_equivalent_to(sharding, value.ndim) \
                else jax.device_put(value, sharding)
        else:
            new[path] = (value, sharding)  # placed once everything is checked
    return {p: (_put(np.asarray(v[0]), v[1]) if isinstance(v, tuple) else v) for p, v in new.items()}


def _from_named(engine, pairs) -> dict:
    """{path: new device array} from (HF name, array) pairs."""
    cfg, runner = engine.model_config, engine.runner
    dtype = np.dtype(NP_DTYPES[engine.config.dtype])
    r = kv_head_replication(cfg, runner.tp)
    parts: dict[tuple, dict] = {}  # (in layers?, key) -> {index: part}
    for name, dests in map_named_tensors(cfg, pairs, source="update_weights"):
        for in_layers, key, where, part in dests:
            if part.dtype != dtype:
                raise ValueError(f"update_weights: tensor {name!r} has dtype {part.dtype}, the engine's is {dtype}")
            parts.setdefault((in_layers, key), {})[where] = part
    params, new = runner.params, {}
    for (in_layers, key), by_index in parts.items():
        current = params["layers"][key] if in_layers else params[key]
        path = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey(key)) if in_layers \
            else (jax.tree_util.DictKey(key),)
        index = sorted(by_index)
        values = np.stack([by_index[i] for i in index]) if in_layers else by_index[()]
        if in_layers:  # KV heads repeated as the runner holds them when tensor parallelism needs it
            values = replicate_kv_heads({"layers": {key: values}}, cfg, r)["layers"][key]
        if isinstance(current, (QArray, QPacked)):  # a quantized engine: quantized as at load
            if in_layers and len(index) != int(np.prod(current.shape[:len(index[0])])):  # some layers
                full = np.array(dequantize(_reference(current)), np.float32)
                full[tuple(np.array(c) for c in zip(*index))] = values
                values = full
            new[path] = _quantized_leaf(current, values.reshape(current.shape), key)
        else:
            new[path] = _new_leaf(current, values, index, in_layers)
    return new


def _packed(a) -> bool:  # a matrix the runner keeps packed or quantized: one parameter here
    return isinstance(a, (Packed, QArray, QPacked))


def _reference(current):
    """A quantized parameter as its QArray (a packed one unpacked); ValueError when its arrays are dropped."""
    ref = current.unpack() if isinstance(current, QPacked) else current
    if not isinstance(ref.q, jax.Array):
        raise ValueError("update_weights: the engine slept at level 2 (its weights are dropped): give every "
                         "layer of each stacked tensor, not some of them")
    return ref


def _quantized_leaf(current, values, name: str) -> QArray:
    """The QArray replacing a quantized parameter (the runner packs it again where it keeps it packed):
    plain values quantized as at load (format, group, minimum or not), on the devices and shardings of the
    current one."""
    shardings = current.unpack() if isinstance(current, QPacked) and isinstance(current.blob, jax.Array) \
        else current
    has_min = current.has_min if isinstance(current, QPacked) else current.m is not None
    values = np.asarray(values, np.float32)
    qa = quantize(values, current.format, current.axis, current.dtype, current.group, name, symmetric=not has_min)
    if isinstance(shardings, QArray) and isinstance(shardings.q, jax.Array):  # the current codes are here
        qa = _unchanged_kept(qa, shardings, values)
    return jax.tree.map(lambda a, old: _put(np.ascontiguousarray(a), old.sharding), qa, shardings)


def _unchanged_kept(qa: QArray, current: QArray, values: np.ndarray) -> QArray:
    """qa with the current codes, scales and minima kept for every matrix of the stack [..., K, N] (every
    layer, expert) whose new values equal the current ones: giving back what `get_weights` gave changes
    nothing (re-quantizing dequantized values with a minimum can move them by a float rounding)."""
    same = np.all(values == np.asarray(dequantize(dataclasses.replace(current, dtype="float32"))), axis=(-2, -1))
    if not same.any():
        return qa
    def keep(new, old):
        new = np.array(new)
        new[same] = np.asarray(old)[same]
        return new
    return jax.tree.map(keep, qa, current)


def _new_leaf(current: jax.Array, values: np.ndarray, index: list, in_layers: bool) -> jax.Array:
    """The device array replacing `current`: whole, or with rows `index` (layers, experts) replaced (a
    plain matrix: the runner packs it again if it keeps it packed)."""
    if not in_layers or len(index) == int(np.prod(current.shape[:len(index[0])])):
        full = values if not in_layers else values.reshape(current.shape)  # every layer (and expert)
        return _put(np.ascontiguousarray(full), current.sharding)
    if isinstance(current, Packed) and isinstance(current.tiles, jax.Array):
        current = current.unpack()
    if not isinstance(current, jax.Array):
        raise ValueError("update_weights: the engine slept at level 2 (its weights are dropped): give every "
                         "layer of each stacked tensor, not some of them")
    rows = tuple(np.array(c, np.int32) for c in zip(*index))
    return _scatter(current.sharding)(current, rows, values)


def update_weights(engine, weights) -> None:
    """Replace some or all of an LLMEngine's parameters (see the module docstring)."""
    engine.pause_control.check_update_allowed()
    if engine.mesh.is_multi_process:
        raise RuntimeError("update_weights is not supported with num_processes > 1")
    new = _from_pytree(engine, weights) if isinstance(weights, dict) else _from_named(engine, weights)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(engine.runner.params, is_leaf=_packed)
    engine.runner.replace_params(jax.tree_util.tree_unflatten(treedef, [new.get(p, a) for p, a in leaves]))
    invalidate_kv(engine.runner, engine.scheduler)  # the pool holds K/V of the old weights
