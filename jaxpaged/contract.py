"""The engine contract: what `LLM`, `AsyncEngine` and the server need from an engine, and all they use.

`Engine` is implemented by `LLMEngine` (jaxpaged/engine.py; a multi-host job's leader is one too) and by
`Replicas` (jaxpaged/parallel/replicas.py); tests/test_engine_contract.py runs the same checks on each.
An engine's controls (pause, sleep, weights, LoRA adapters: vLLM's names) are one facet,
`engine.controls`, an `EngineControls`; `ControlsFront` makes them reachable as the front's own
attributes too (`llm.sleep()`, `engine.add_lora(...)`), without a forwarding method for each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from jaxpaged.config import EngineConfig, ModelConfig
    from jaxpaged.core.outputs import RequestOutput
    from jaxpaged.core.structured import StructuredOutputsParams
    from jaxpaged.core.tokenizer import Tokenizer


class EngineControls(Protocol):
    """Pause, sleep, weights and LoRA adapters of a running engine (docs/research.md: the RL recipe)."""

    def pause_generation(self, mode: str = "abort", wait: bool = True) -> list[RequestOutput]:
        """Pause: "abort" finishes unfinished requests now, "wait" runs the running ones to their end,
        "keep" freezes them (an `update_weights` meanwhile recomputes their KV under the new weights).
        Returns the outputs the pause produced (jaxpaged/controls/pause.py). wait=False ("wait" only):
        the caller's steps drain the running requests."""

    def resume_generation(self) -> None:
        """Undo pause_generation: waiting and kept requests are scheduled again."""

    @property
    def is_paused(self) -> bool:
        """From pause_generation to resume_generation."""

    def sleep(self, level: int = 1) -> dict:
        """Release device memory: level 1 deletes the KV pool and moves the weights to host memory, level
        2 drops the weights too. Returns device bytes {"before", "after"} (jaxpaged/controls/sleep.py)."""

    def wake_up(self, reload: bool = False) -> dict:
        """Undo sleep without recompiling; `reload=True` reads the weights from the model directory again
        (after level 2, unless a full update_weights already gave them). Returns device bytes."""

    @property
    def sleep_level(self) -> int:
        """0 awake, else the level of the last sleep."""

    def get_weights(self) -> dict:
        """The parameter pytree the steps run on (device arrays; layout in jaxpaged/models/llama.py)."""

    def update_weights(self, weights) -> None:
        """Load new weights into the running engine, without recompiling (docs/research.md).

        `weights`: an iterable of (Hugging Face tensor name, array) pairs, as vLLM's `load_weights` takes
        them (any subset of the checkpoint's tensors), or (part of) the pytree `get_weights` returns.
        Shapes and dtypes must match the engine's (ValueError naming the tensor; nothing changes). Device
        arrays with the engine's sharding are adopted without a copy; arrays sharded otherwise are
        resharded device to device. The KV cache is invalidated. Refused (RuntimeError) while requests
        run: call it between `generate` calls or while paused (jaxpaged/checkpoints/weight_update.py)."""

    def add_lora(self, lora_request) -> bool:
        """Register and load a LoRA adapter (a LoRARequest naming a PEFT directory); False if known."""

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (ValueError while unfinished requests use it); False if unknown."""

    def list_loras(self) -> list[int]:
        """The registered adapters' lora_int_ids."""

    def lora_requests(self) -> list:
        """The registered adapters' LoRARequests, in lora_int_id order."""

    def update_lora(self, lora_int_id: int, weights) -> None:
        """Replace an adapter's A/B without recompiling (RL: after a training step). `weights`:
        PEFT-named (name, array) pairs or a dict of them (scaled by the adapter's config), or
        {"a": {leaf: [L, in, r]}, "b": {leaf: [L, r, out]}} (scaling folded into b). Refused while
        requests are unfinished; the KV cache is invalidated."""


class Engine(Protocol):
    """add / abort / step, the limits requests are checked against, counters, and the controls facet."""

    config: EngineConfig
    model_config: ModelConfig
    model_dir: str
    tokenizer: Tokenizer | None
    max_model_len: int
    eos_token_ids: list[int]
    controls: EngineControls

    def request_limits(self) -> dict:
        """The model-dependent bounds `add_request` enforces (the server states them in its schema)."""

    def add_request(self, request_id: str | None, prompt, params=None, arrival_time: float | None = None,
                    stream: bool = True, lora_request=None) -> str:
        """Queue a request; ValueError naming the field (nothing queued) if it is invalid. Returns its id.
        stream=False: `step` returns only the request's final output. `lora_request`: the LoRARequest it
        runs with (registered and loaded now when new)."""

    def prepare_structured(self, structured_outputs: StructuredOutputsParams) -> None:
        """Compile a grammar matcher ahead of `add_request` (safe from another thread than the stepping one)."""

    def abort_request(self, request_id: str) -> None:
        """Finish the request now (a no-op for unknown or finished ids)."""

    def has_unfinished_requests(self) -> bool:
        """Whether some request has not finished (or a step is still in flight)."""

    def can_step(self) -> bool:
        """Whether `step` would compute anything: unfinished requests, not asleep, not paused (or draining)."""

    def step(self) -> list[RequestOutput]:
        """Advance the running requests by one step; the outputs of those that changed."""

    def stats(self) -> dict:
        """Counters (core/iteration_stats.py, the KV pool, compilations, failures, LoRA, speculation)."""

    @property
    def num_consecutive_step_failures(self) -> int:
        """Failed steps since the last one that succeeded (the server stops after too many)."""

    def score(self, prompts: list, continuations: list) -> list[list[float]]:
        """The logprob of each continuation token after its prompt (jaxpaged/step/scoring.py)."""


CONTROL_NAMES = frozenset(n for n in vars(EngineControls) if not n.startswith("_"))


class ControlsFront:
    """Mixin: the members of `self.controls` (an EngineControls) read as the object's own attributes."""

    def __getattr__(self, name: str):
        if name in CONTROL_NAMES:
            return getattr(self.controls, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
