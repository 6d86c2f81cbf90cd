"""Tiny random Hugging Face models of every supported family, saved to disk, for tests."""
from __future__ import annotations

import os

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def make_tiny_model(path: str, family: str = "llama", *, vocab_size: int = 256, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                    tie: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                    initializer_range: float = 0.5, max_position_embeddings: int = 512,
                    dtype: str = "float32", max_shard_size: str | None = None) -> str:
    """Save a random model (config.json + safetensors, no tokenizer) and return its directory."""
    import torch
    import transformers as tf
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie,
                  initializer_range=initializer_range, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if head_dim is not None:
        common["head_dim"] = head_dim
    if family == "llama":
        cfg = tf.LlamaConfig(rope_scaling=rope_scaling, **common)
    elif family == "mistral":
        cfg = tf.MistralConfig(sliding_window=None, **common)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(use_sliding_window=False, **common)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(use_sliding_window=False, **common)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


_CORPUS = ("The quick brown fox jumps over the lazy dog. Hello world! Paged attention stores keys and "
           "values in blocks. Ünïcödé façade naïve café — 東京 日本語 😀 emoji. ") * 20

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def add_tiny_tokenizer(path: str, vocab_size: int = 300) -> None:
    """Train a byte-level BPE on a small multilingual corpus and save it (with a chat template) to `path`.

    Multi-byte characters span several tokens, so incremental detokenization is exercised."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
