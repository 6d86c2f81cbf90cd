"""An engine's controls, below the engine and built into it: pause / resume generation (`pause.py`), sleep /
wake releasing device memory (`sleep.py`), invalidating the KV cache (`kv.py`), and the facet joining them
with weights and LoRA adapters under vLLM's names (`facet.py`: `engine.controls`)."""
