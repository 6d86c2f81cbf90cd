"""The decoder layers' two layouts in the parameter pytree, and the conversions between them.

- **Stacked**: `params["layers"]` a dict of leaves `[L, ...]` (QArrays: q and scale alike). Weights are
  loaded, converted, saved, partitioned (`parallel/mesh.param_partition_specs`) and exchanged
  (`LLM.get_weights` / `update_weights`) in this layout; `llama.decoder` runs it under a `lax.scan`.
- **Per layer**: `params["layers"]` a tuple of L dicts, each leaf one layer's whole array. This is what
  the engine's step reads (`ModelRunner.params`): `llama.decoder` unrolls the layers over it, so every
  product reads its matrix where it lies. A scan over stacked leaves copies each layer's slice out of the
  stack first (XLA CPU: a dynamic-slice fusion per matrix, the layer weights written and read again every
  step; docs/benchmarks.md, "A lone request").

The per-layer arrays of a device pytree keep the stacked arrays' shardings less the layer axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

LAYERS = jax.tree_util.DictKey("layers")


def is_per_layer(params: dict) -> bool:
    """Whether `params["layers"]` is the per-layer tuple (else the stacked dict)."""
    return isinstance(params["layers"], (tuple, list))


def unstack(params: dict, num_layers: int, take=lambda a, l: a[l], is_leaf=None) -> dict:
    """Stacked -> per layer: layer l's leaves are `take(leaf, l)` (default `leaf[l]`: numpy views of host
    arrays; pass another `take` for shapes or partition specs)."""
    layers = params["layers"]
    return {**params, "layers": tuple(jax.tree.map(lambda a: take(a, l), layers, is_leaf=is_leaf)
                                      for l in range(num_layers))}


def unstack_shapes(params: dict, num_layers: int) -> dict:
    """Stacked `jax.ShapeDtypeStruct`s with `NamedSharding`s -> per layer (the layer axis dropped from
    shapes and partition specs): what placing the arrays would give, allocating nothing."""
    def take(a, l):
        sharding = NamedSharding(a.sharding.mesh, P(*a.sharding.spec[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)
    return unstack(params, num_layers, take)


def _stacked_sharding(a):
    return NamedSharding(a.sharding.mesh, P(None, *a.sharding.spec))


def stacked_shapes(params: dict) -> dict:
    """The stacked layout's `jax.ShapeDtypeStruct`s (with shardings) of a per-layer device pytree; no copy."""
    L = len(params["layers"])
    layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct((L,) + a.shape, a.dtype, sharding=_stacked_sharding(a)),
                          params["layers"][0])
    return {**params, "layers": layers}


def stacked(params: dict, keys=None) -> dict:
    """A per-layer device pytree in the stacked layout (new device arrays for the layers; other leaves as
    they are). keys: only these layer leaves (default all)."""
    layers = params["layers"]
    keys = list(layers[0]) if keys is None else list(keys)
    parts = [{k: layer[k] for k in keys} for layer in layers]
    shardings = jax.tree.map(_stacked_sharding, parts[0])
    out = jax.jit(lambda ps: jax.tree.map(lambda *a: jnp.stack(a), *ps), out_shardings=shardings)(parts)
    return {**params, "layers": out}


def replace(params: dict, new: dict) -> dict:
    """A per-layer device pytree with some leaves replaced: new = {path in the stacked layout: array};
    a stacked layer leaf is split into its layers, each with the sharding of the leaf it replaces."""
    L = len(params["layers"])
    by_layer = {}  # stacked path -> its L slices
    for path, value in new.items():
        if path[0] == LAYERS:
            one = _leaf_at(params["layers"][0], path[1:])
            by_layer[path] = jax.jit(lambda a: tuple(a[l] for l in range(L)),
                                     out_shardings=(one.sharding,) * L)(value)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, a in leaves:
        if path[0] == LAYERS:  # (layers, layer index, key, ...) -> (layers, key, ...)
            key = (LAYERS,) + path[2:]
            out.append(by_layer[key][path[1].idx] if key in by_layer else a)
        else:
            out.append(new.get(path, a))
    return jax.tree_util.tree_unflatten(treedef, out)


def _leaf_at(tree, path):
    for k in path:
        tree = tree[k.key] if isinstance(k, jax.tree_util.DictKey) else getattr(tree, k.name)
    return tree
