"""Hugging Face transformers (PyTorch, CPU, float32) as the numeric oracle."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    import torch
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF with EOS neither stopping nor masked (a plain argmax loop, KV cached)."""
    import torch
    model = hf_model(path)
    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def hf_last_logits(path: str, prompt: list[int]):
    import torch
    with torch.no_grad():
        return hf_model(path)(torch.tensor([prompt])).logits[0, -1].numpy()


def hf_routed_experts(path: str, tokens: list[int]):
    """The experts HF's MoE model routes each of `tokens` to: i32[len(tokens), L, k], the top k of the
    softmax of each layer's router logits (`output_router_logits=True`)."""
    import torch
    model = hf_model(path)
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits  # L x [T, E]
    return torch.stack([torch.topk(torch.softmax(l.float(), -1), k, dim=-1).indices for l in logits],
                       dim=1).numpy().astype("int32")
