"""The default model's golden prompts: texts as they are, chats through its chat template. The default model's
tests (tests/test_default_model.py) check its greedy outputs on them; `jaxpaged bench quality` measures
quantized weights and KV caches on them."""
from __future__ import annotations

TEXTS = ["The three primary colors are", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The capital of Japan is"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are a terse assistant."},
          {"role": "user", "content": "Name two planets."}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


def golden_prompts(tokenizer) -> list[list[int]]:
    """Token ids of the golden prompts (texts as they are, chats through the template), texts first."""
    return [tokenizer.encode(t) for t in TEXTS] + [tokenizer.apply_chat_template(c) for c in CHATS]
