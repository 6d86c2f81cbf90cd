"""Weights in and out: safetensors / orbax / GGUF loading, conversion, the default model, weight updates."""
