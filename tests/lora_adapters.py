"""PEFT LoRA adapters of tiny models, saved to disk, and PEFT as the oracle (for tests/test_lora*.py)."""
from __future__ import annotations

import functools

TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: str, base: str, family: str = "llama", *, r: int = 4, alpha: float = 8.0,
                 rslora: bool = False, seed: int = 0, targets: list | None = None, scale: float = 0.3) -> str:
    """Save a PEFT LoRA adapter with random (non-zero) A and B for the model in `base`; return `path`."""
    import peft
    import torch
    torch.manual_seed(seed)
    model = _base(base)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, init_lora_weights=False,
                          target_modules=targets or TARGETS.get(family, ALL), lora_dropout=0.0)
    m = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    m.save_pretrained(path)
    m.unload()
    return path


def _base(base: str):
    import torch
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=8)
def peft_model(base: str, adapter: str | None):
    """The base model with the adapter applied by PEFT (None: the base alone)."""
    import peft
    model = _base(base)
    return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()


def peft_last_logits(base: str, adapter: str | None, prompt: list[int]):
    import torch
    with torch.no_grad():
        return peft_model(base, adapter)(torch.tensor([prompt])).logits[0, -1].numpy()


def peft_greedy(base: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    """A plain argmax loop (no KV cache: tiny models, short outputs)."""
    import torch
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(peft_model(base, adapter)(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
