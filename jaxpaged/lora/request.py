"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: `lora_name` (what the server's `model` field names), `lora_int_id` (> 0, unique per
    adapter; 0 means the base model), `lora_path` (a Hugging Face PEFT directory)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
