"""`Replicas.controls`: the `EngineControls` (jaxpaged/contract.py) of data-parallel replicas, every replica
alike: a pause, sleep, weight update or adapter change reaches each one; what is read (weights, adapters,
whether paused) is replica 0's, the replicas being identical."""
from __future__ import annotations


def _sum_bytes(per: list[dict]) -> dict:
    return {when: {k: sum(p[when][k] for p in per) for k in per[0][when]} for when in ("before", "after")}


class ReplicaControls:
    def __init__(self, replicas):
        self.replicas = replicas

    @property
    def _engines(self) -> list:
        return self.replicas.engines

    # -- pause ------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort", wait: bool = True) -> list:
        outputs = [o for e in self._engines for o in e.controls.pause_generation(mode, wait)]
        self.replicas.forget_finished(outputs)
        return outputs

    def resume_generation(self) -> None:
        for e in self._engines:
            e.controls.resume_generation()

    @property
    def is_paused(self) -> bool:
        return self._engines[0].controls.is_paused

    # -- sleep ------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        """Every replica asleep; device bytes {"before", "after"} summed over the replicas."""
        return _sum_bytes([e.controls.sleep(level) for e in self._engines])

    def wake_up(self, reload: bool = False) -> dict:
        return _sum_bytes([e.controls.wake_up(reload) for e in self._engines])

    @property
    def sleep_level(self) -> int:
        return self._engines[0].controls.sleep_level

    # -- weights ----------------------------------------------------------------------------
    def get_weights(self) -> dict:
        """Replica 0's parameter pytree (every replica holds the same values)."""
        return self._engines[0].controls.get_weights()

    def update_weights(self, weights) -> None:
        """The same update on every replica (pairs are read once; device arrays copied to each replica)."""
        for e in self._engines:  # checked here too: no replica may be left on the old weights
            e.pause_control.check_update_allowed()
        weights = weights if isinstance(weights, dict) else list(weights)
        for e in self._engines:
            e.controls.update_weights(weights)

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora_request) -> bool:
        """Registered and loaded on every replica (a request may be routed to any)."""
        return any([e.controls.add_lora(lora_request) for e in self._engines])

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgotten on every replica; ValueError (nothing removed) while unfinished requests use it."""
        for e in self._engines:
            e.lora.check_unused(lora_int_id)
        return any([e.controls.remove_lora(lora_int_id) for e in self._engines])

    def list_loras(self) -> list[int]:
        return self._engines[0].controls.list_loras()

    def lora_requests(self) -> list:
        return self._engines[0].controls.lora_requests()

    def update_lora(self, lora_int_id: int, weights) -> None:
        """The same A/B on every replica; RuntimeError (nothing changed) while requests are unfinished."""
        for e in self._engines:
            e.lora.check_idle()
        weights = weights if isinstance(weights, dict) else list(weights)
        for e in self._engines:
            e.controls.update_lora(lora_int_id, weights)
