"""Tiny random Hugging Face models of every supported family, saved to disk, for tests and benchmarks."""
from __future__ import annotations

import os

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# the families of issue 13, with sliding windows of 8 tokens (blocks of 4 in their tests: windows cross
# blocks), Gemma 3 with 4 layers of pattern sliding, sliding, full (a scanned group of 3 and a tail)
NEW_FAMILIES = ("mistral_sw", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "olmoe", "qwen2_sw")
WINDOW = 8


def make_tiny_model(path: str, family: str = "llama", *, vocab_size: int = 256, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                    tie: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                    initializer_range: float = 0.5, max_position_embeddings: int = 512,
                    dtype: str = "float32", max_shard_size: str | None = None, **extra) -> str:
    """Save a random model (config.json + safetensors, no tokenizer) and return its directory.

    `extra` goes to the HF config class (e.g. rope_scaling for Phi-3)."""
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
    elif family == "qwen2_sw":  # layer 0 full, the others sliding (max_window_layers)
        cfg = tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common, **extra)
    elif family == "mistral_sw":
        cfg = tf.MistralConfig(sliding_window=WINDOW, **common, **extra)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**{**common, "head_dim": head_dim or 16}, sliding_window=WINDOW,
                              **{"query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
                                 "final_logit_softcapping": 8.0, **extra})
    elif family == "gemma3":
        sw, full = "sliding_attention", "full_attention"
        common["num_hidden_layers"] = 4
        cfg = tf.Gemma3TextConfig(**{**common, "head_dim": head_dim or 16}, sliding_window=WINDOW,
                                  query_pre_attn_scalar=24, final_logit_softcapping=8.0,
                                  layer_types=[sw, sw, full, sw],
                                  rope_parameters={sw: {"rope_type": "default", "rope_theta": 100.0},
                                                   full: {"rope_type": "linear", "factor": 4.0,
                                                          "rope_theta": 10000.0}}, **extra)
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif family == "phi3":
        cfg = tf.Phi3Config(**common, pad_token_id=0, **extra)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, **extra)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                norm_topk_prob=True, **extra)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, pad_token_id=0, **extra)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


CORPUS = ("The quick brown fox jumps over the lazy dog. Hello world! Paged attention stores keys and "
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
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def one_prompt_decoder_inputs(path: str, cfg, prompt: list[int]):
    """(params, pool, batch) for calling `llama.decoder` directly on one prompt: the model's float32
    parameters as jax arrays, a zero pool of 2 blocks of 16 per layer, the prompt in block 1 of slot 0."""
    import jax.numpy as jnp

    from jaxpaged.checkpoints.weights import load_params
    params = {k: (jnp.asarray(v) if k != "layers" else {n: jnp.asarray(a) for n, a in v.items()})
              for k, v in load_params(path, cfg, "float32").items()}
    pool = jnp.zeros((cfg.num_layers * 2, 16, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    n = len(prompt)
    batch = dict(input_ids=jnp.array(prompt, jnp.int32), positions=jnp.arange(n, dtype=jnp.int32),
                 slot_mapping=jnp.arange(n, dtype=jnp.int32) + 16, block_tables=jnp.array([[1]], jnp.int32),
                 seq_lens=jnp.array([n], jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32))
    return params, pool, batch
