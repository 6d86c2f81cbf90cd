"""Sleep / wake (vLLM's `sleep(level)` / `wake_up()`): release the engine's device memory between
rollouts, for a trainer sharing the devices, and take it back without recompiling.

- level 1: the KV pool's device arrays are deleted and the parameters copied to host memory, then
  deleted on the device.
- level 2: the parameters are dropped too. A full `update_weights` (every parameter) brings them back,
  or `wake_up(reload=True)`, which reads the model directory again.
`wake_up()` puts the parameters back with the shardings they had and a zeroed KV pool, so every compiled
step runs on as before (`stats()["num_compilations"]` does not change). The prefix cache is flushed (its
blocks' K/V are gone); requests kept by `pause_generation(mode="keep")` are recomputed. While asleep,
`step` raises RuntimeError and requests may be queued. The runner holds `jax.ShapeDtypeStruct`s (with
their shardings) in place of the deleted arrays, so shapes stay checkable (`update_weights`).
"""
from __future__ import annotations

import jax

from jaxpaged.checkpoints.weights import load_params, release_host_memory
from jaxpaged.controls.kv import invalidate_kv
from jaxpaged.step.mesh import place_params

SLEEP_LEVELS = (1, 2)


class SleepControl:
    """An engine's sleep: its level (0 awake, 1 or 2) and, asleep at level 1, the parameters on the host."""

    def __init__(self, engine):
        self.engine = engine
        self.level = 0
        self._host_params = None

    def check_awake(self) -> None:
        if self.level:
            raise RuntimeError(f"the engine is asleep (level {self.level}): call wake_up() first")

    def device_bytes(self) -> dict:
        """What the engine's devices hold now: `engine_bytes` (its parameters and KV pool, every shard),
        `live_array_bytes` (every live jax.Array's shards on the engine's mesh, the engine's and any other
        the process holds) and, where the backend reports it (GPU, TPU), `bytes_in_use` summed over
        `device.memory_stats()`."""
        devices = set(self.engine.mesh.devices.flat)
        live = sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device in devices)
        own = sum(s.data.nbytes for a in self.engine.runner.device_arrays() for s in a.addressable_shards)
        out = dict(engine_bytes=int(own), live_array_bytes=int(live))
        stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
        if all(s is not None and "bytes_in_use" in s for s in stats):
            out["bytes_in_use"] = int(sum(s["bytes_in_use"] for s in stats))
        return out

    def sleep(self, level: int = 1) -> dict:
        """Go to sleep at `level`; returns {"before": device_bytes, "after": ...}."""
        engine = self.engine
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self.level:
            raise RuntimeError(f"the engine is already asleep (level {self.level})")
        if engine.mesh.is_multi_process:
            raise RuntimeError("sleep is not supported with num_processes > 1")
        try:
            engine.pause_control.check_update_allowed()
        except RuntimeError:
            raise RuntimeError("sleep: the engine has unfinished requests; sleep between generate calls or "
                               "after pause_generation()") from None
        before = self.device_bytes()
        invalidate_kv(engine.runner, engine.scheduler)  # kept requests (paused) lose their KV
        self._host_params = engine.runner.offload(keep_params=level == 1)
        self.level = level
        return dict(before=before, after=self.device_bytes())

    def wake_up(self, reload: bool = False) -> dict:
        """Wake up: parameters back (from host memory; from the model directory with `reload`; or as a full
        `update_weights` already put them) and a zeroed KV pool. Returns device bytes before/after."""
        engine, runner = self.engine, self.engine.runner
        if not self.level:
            raise RuntimeError("wake_up: the engine is not asleep")
        before = self.device_bytes()
        if reload:
            c = engine.config
            host = load_params(engine.model_dir, engine.model_config, c.dtype, quantization=c.quantization,
                               group_size=c.quantization_group_size, symmetric=c.quantization_symmetric)
            runner.replace_params(place_params(host, engine.model_config, runner.mesh))
        elif self._host_params is None and not runner.params_on_device:
            raise RuntimeError("wake_up: the engine slept at level 2 and its weights were dropped; call "
                               "update_weights with every parameter first, or wake_up(reload=True)")
        runner.restore(self._host_params)  # leaves an update_weights gave while asleep are kept
        self._host_params = None
        release_host_memory()
        self.level = 0
        return dict(before=before, after=self.device_bytes())
