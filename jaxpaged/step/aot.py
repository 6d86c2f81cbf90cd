"""The engine's step compiled ahead of time for any mesh, with no weights and no device memory.

The step compiled here is the one `ModelRunner` runs (same function, shardings, buckets, kernels), over an
abstract model: parameters and pools are `jax.ShapeDtypeStruct`s sharded on the mesh. The mesh may hold
compile-only devices of another platform (`jax.experimental.topologies.get_topology_desc`): on this
CPU-only host a step compiles for an H200 (sm_90a) or a TPU v5e/v6e slice with the real kernels, and
`memory_analysis()` / `cost_analysis()` of the executables say whether it fits and what it would cost.

    runner = abstract_runner(model_cfg, EngineConfig(dtype="bfloat16", ...), mesh, num_blocks=4096)
    steps = compile_steps(runner)        # {(T, decode_only): jax.stages.Compiled}
"""
from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpaged.checkpoints.weights import empty_params
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.step.mesh import MODEL_AXIS, leaf_specs, param_partition_specs, sharded_model_config
from jaxpaged.step.runner import ModelRunner


def abstract_params(cfg: ModelConfig, dtype: str, quantization: str | None, mesh: Mesh) -> dict:
    """The parameter pytree as ShapeDtypeStructs sharded on `mesh` (KV heads replicated as the engine
    would: the shapes of `place_params`' output), allocating nothing."""
    tp = mesh.shape[MODEL_AXIS]
    shapes = empty_params(sharded_model_config(cfg, tp), dtype, quantization,
                          alloc=lambda shape, dt: jax.ShapeDtypeStruct(tuple(shape), dt))
    specs = leaf_specs(param_partition_specs(cfg, tp), shapes, tp)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
                        shapes, specs)


def abstract_runner(model_cfg: ModelConfig, cfg: EngineConfig, mesh: Mesh, num_blocks: int,
                    max_model_len: int | None = None) -> ModelRunner:
    """A ModelRunner over an abstract model on `mesh` (its "model" axis = cfg.tensor_parallel_size).
    max_model_len defaults to the engine's (cfg.max_model_len, else the model's capped at 4096). Set
    cfg.dtype explicitly ("auto" reads this host's backend) and compilation_cache_dir=None unless the
    executables for the target should go to the persistent cache."""
    if mesh.shape[MODEL_AXIS] != cfg.tensor_parallel_size:
        raise ValueError(f"mesh has {mesh.shape[MODEL_AXIS]} devices on its model axis, but "
                         f"tensor_parallel_size is {cfg.tensor_parallel_size}")
    params = abstract_params(model_cfg, cfg.dtype, cfg.quantization, mesh)
    max_model_len = max_model_len or cfg.max_model_len or min(model_cfg.max_position_embeddings, 4096)
    return ModelRunner(model_cfg, cfg, params, num_blocks, max_model_len, mesh=mesh, abstract=True)


def compile_steps(runner: ModelRunner, variants=None) -> dict:
    """Compile the runner's step variants (default: all of them, as the engine's warm-up does):
    {(T, decode_only): jax.stages.Compiled}."""
    return {v: runner.compiled_step(v) for v in (runner.variants() if variants is None else variants)}
