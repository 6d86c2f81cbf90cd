"""`LLMEngine.controls`: one engine's pause, sleep, weights and LoRA adapters (the `EngineControls` of
jaxpaged/contract.py, where each member is documented), joined from the parts that hold them: the pause
(`pause.py`), the sleep (`sleep.py`), the weight update (jaxpaged/checkpoints/weight_update.py) and the
LoRA administration (jaxpaged/lora/manager.py)."""
from __future__ import annotations

import jax

from jaxpaged.checkpoints.weight_update import update_weights
from jaxpaged.models.qarray import QArray, dequantize
from jaxpaged.models.quant import unpack_layers


class Controls:
    """The controls of `engine` (a weak proxy of it: the engine holds this facet), through its
    `pause_control`, `sleep_control` and `lora`."""

    def __init__(self, engine):
        self.engine = engine

    # -- pause ------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort", wait: bool = True) -> list:
        return self.engine.pause_control.pause(mode, wait)

    def resume_generation(self) -> None:
        self.engine.pause_control.resume()

    @property
    def is_paused(self) -> bool:
        return self.engine.pause_control.is_paused

    # -- sleep ------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        return self.engine.sleep_control.sleep(level)

    def wake_up(self, reload: bool = False) -> dict:
        return self.engine.sleep_control.wake_up(reload)

    @property
    def sleep_level(self) -> int:
        return self.engine.sleep_control.level

    # -- weights ----------------------------------------------------------------------------
    def get_weights(self) -> dict:
        """Every matrix as the model lays it out, plain (a copy of those the runner keeps packed for the CPU
        matmul kernels; quantized ones dequantized to the engine dtype)."""
        return jax.tree.map(lambda a: dequantize(a) if isinstance(a, QArray) and isinstance(a.q, jax.Array) else a,
                            unpack_layers(self.engine.runner.params), is_leaf=lambda a: isinstance(a, QArray))

    def update_weights(self, weights) -> None:
        update_weights(self.engine, weights)

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora_request) -> bool:
        return self.engine.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.lora.remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.engine.lora.ids()

    def lora_requests(self) -> list:
        return self.engine.lora.requests()

    def update_lora(self, lora_int_id: int, weights) -> None:
        self.engine.lora.update(lora_int_id, weights)
