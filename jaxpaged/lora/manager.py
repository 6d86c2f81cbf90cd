"""The engine's LoRA administration: registering, removing, listing and updating adapters.

The adapters' weights live in the runner's device slots (`slots.py`); what an adapter change means for
the rest of the engine lives here: an adapter in use by unfinished requests cannot be removed, an
update invalidates the KV cache (`controls/kv.py`), a removal drops the prefix cache (an id may come back
with other weights: no cached block of the old ones may serve it; the running requests, of other adapters,
keep their KV). With LoRA off every call but `lora_int_id(None)` is a ValueError naming `enable_lora`.
"""
from __future__ import annotations

from jaxpaged.controls.kv import invalidate_kv


class LoRAManager:
    def __init__(self, slots, scheduler, executor):
        self._slots, self.scheduler = slots, scheduler
        self.executor = executor  # a step in flight counts as unfinished requests; its runner holds the KV

    @property
    def slots(self):
        if self._slots is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        return self._slots

    def lora_int_id(self, lora_request) -> int:
        """The adapter id a request runs with (0: the base model), registering and loading it when new."""
        if lora_request is None:
            return 0
        self.add(lora_request)
        return lora_request.lora_int_id

    def add(self, lora_request) -> bool:
        """Register and load a LoRARequest's PEFT adapter (checked now: ValueError naming what is wrong);
        False if it is registered already."""
        return self.slots.add(lora_request)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if unknown. ValueError while unfinished requests use it."""
        self.check_unused(lora_int_id)
        removed = self.slots.remove(lora_int_id)
        if removed:
            self.scheduler.bm.reset_prefix_cache()
        return removed

    def check_unused(self, lora_int_id: int) -> None:
        """ValueError if unfinished requests run with the adapter."""
        sch = self.scheduler
        users = [r for r in sch.running + list(sch.waiting) if r.lora_int_id == lora_int_id]
        if users:
            raise ValueError(f"lora_int_id {lora_int_id} is used by {len(users)} unfinished requests")

    def check_idle(self) -> None:
        """RuntimeError while requests are unfinished (a step in flight counts)."""
        if self.scheduler.has_unfinished() or self.executor.in_flight is not None:
            raise RuntimeError("update_lora: requests are unfinished; call it between generate calls")

    def ids(self) -> list[int]:
        """The registered adapters' lora_int_ids."""
        return sorted(self.slots.registered)

    def requests(self) -> list:
        """The registered adapters' LoRARequests (in lora_int_id order)."""
        registered = self.slots.registered
        return [registered[i] for i in sorted(registered)]

    def update(self, lora_int_id: int, weights) -> None:
        """Replace a registered adapter's A/B in place, without recompiling (`LoRASlots.update`); the KV
        cache is invalidated. Refused (RuntimeError) while requests are unfinished."""
        self.check_idle()
        self.slots.update(lora_int_id, weights)
        invalidate_kv(self.executor.runner, self.scheduler)

    def stats(self) -> dict:
        return self._slots.stats() if self._slots is not None else {}
