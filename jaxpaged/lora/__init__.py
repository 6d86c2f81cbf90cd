"""LoRA adapters: requests, PEFT loading, device slots and the batched product (docs/architecture.md)."""
