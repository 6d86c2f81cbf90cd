"""Tiny GGUF files written from tiny HF models (jaxpaged/testing/tiny_models.py) as llama.cpp writes them,
with gguf-py's GGUFWriter: for the tests of the GGUF reader and the engine on GGUF files."""
from __future__ import annotations

import json
import os

import numpy as np

from jaxpaged.testing.gguf_kquant import quantize_q4_k

# HF model_type -> GGUF general.architecture (llama.cpp writes Mistral and Mixtral as llama)
GGUF_ARCH = {"mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3"}


def write_gguf(hf_dir: str, path: str, qtype: str = "F32", arch: str | None = None, zeros_as: dict | None = None,
               values: dict | None = None, tokenizer_from: str | None = None) -> str:
    """A GGUF of the HF model in `hf_dir` as llama.cpp writes one: its names, Q/K rows permuted for the llama
    architecture, Gemma's norm scales as 1 + w, the experts of a layer stacked [E, out, in] in one tensor,
    matrices in `qtype` (F32 where a row is not a whole number of its blocks), 1-D tensors in F32, the
    tokenizer and chat template as metadata; returns `path`.
    qtype: F32, a type gguf-py quantizes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), or Q4_K (jaxpaged/testing/gguf_kquant.py).
    arch: the file's architecture (default: llama.cpp's name for the model's).
    zeros_as: {gguf name: type name}, tensors written as zero bytes of that type instead.
    values: filled with {HF name: float32 array}, what the file holds read back the HF way (the tensors
    dequantized by gguf.quants.dequantize, the permutation and the 1 undone): the reference model's weights.
    tokenizer_from: a GGUF file whose tokenizer metadata (every `tokenizer.*` entry) the file takes as it is,
    instead of the one built from `hf_dir`'s tiny tokenizer (tiny_models.add_tiny_tokenizer)."""
    import gguf

    from jaxpaged.checkpoints.weights import read_safetensors, safetensors_files
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    model_type = c["model_type"]
    gguf_arch = GGUF_ARCH.get(model_type, model_type)
    arch = arch or gguf_arch
    w = gguf.GGUFWriter(path, arch)
    heads, kv = _metadata(w, c, arch)
    if tokenizer_from is None:
        _tokenizer(w, hf_dir)
    else:
        _copy_tokenizer(w, tokenizer_from)
    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[gguf_arch]
    name_map = gguf.get_tensor_name_map(arch_enum, c["num_hidden_layers"])
    qt = gguf.GGMLQuantizationType[qtype]
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, a in (t for f in safetensors_files(hf_dir) for t in read_safetensors(f)):  # memory-mapped
        a = a.astype(np.float32)
        if name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue  # llama.cpp writes no output matrix for tied embeddings
        if ".experts." in name:  # model.layers.i.<prefix>.experts.e.<matrix>.weight
            head, rest = name.split(".experts.")
            e, matrix = rest.split(".", 1)
            experts.setdefault(f"{head}.experts.{matrix}", {})[int(e)] = a
            continue
        if gguf_arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else kv
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if gguf_arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + 1  # llama.cpp stores Gemma's norm scales as 1 + w
        base, suffix = name.rsplit(".", 1)
        held = _add(w, f"{name_map.get_name(base)}.{suffix}", a, qt, zeros_as, values is not None)
        if values is not None:
            if gguf_arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                n = heads if ".q_proj." in name else kv
                held = held.reshape(n, held.shape[0] // n // 2, 2, *held.shape[1:]).swapaxes(1, 2).reshape(held.shape)
            if gguf_arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                held = held - 1
            values[name] = held
    for name, per_expert in experts.items():
        base, suffix = name.rsplit(".", 1)
        held = _add(w, f"{name_map.get_name(base)}.{suffix}", np.stack([per_expert[e] for e in sorted(per_expert)]),
                    qt, zeros_as, values is not None)
        if values is not None:
            head, matrix = name.split(".experts.")
            values.update({f"{head}.experts.{e}.{matrix}": held[e] for e in sorted(per_expert)})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add(w, gname: str, a: np.ndarray, qt, zeros_as: dict | None, held: bool) -> np.ndarray | None:
    """Write one tensor; return the float32 values the file holds for it (what gguf dequantizes) where `held`."""
    import gguf
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if gname in (zeros_as or {}):
        t = gguf.GGMLQuantizationType[zeros_as[gname]]
        block, size = gguf.GGML_QUANT_SIZES[t]
        w.add_tensor(gname, np.zeros((*a.shape[:-1], a.shape[-1] // block * size), np.uint8), raw_dtype=t)
        return np.zeros_like(a)
    if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32 or a.shape[-1] % block:
        w.add_tensor(gname, a)
        return a
    data = quantize_q4_k(a) if qt == gguf.GGMLQuantizationType.Q4_K else gguf.quants.quantize(a, qt)
    w.add_tensor(gname, data, raw_dtype=qt)
    return gguf.quants.dequantize(data, qt).reshape(a.shape).astype(np.float32) if held else None


def _metadata(w, c: dict, arch: str) -> tuple[int, int]:
    """The hyperparameters as llama.cpp's converter writes them; returns (heads, kv heads)."""
    import gguf
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    rp = c.get("rope_parameters") or {}
    rp = rp.get("full_attention", rp)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c.get("rope_theta") or rp["rope_theta"])
    if rp.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    if c.get("sliding_window") and arch in ("llama", "gemma2", "gemma3"):  # Mistral's window; Gemma's
        w.add_sliding_window(c["sliding_window"])
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", c["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", c["final_logit_softcapping"])
    n_experts = c.get("num_local_experts") or c.get("num_experts")
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    return heads, kv


def _tokenizer(w, hf_dir: str) -> None:
    """The byte-level BPE tokenizer of tiny_models.add_tiny_tokenizer, and the chat template, as metadata."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tj["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_pad_token_id(vocab["<pad>"])
    w.add_add_bos_token(False)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        template = json.load(f).get("chat_template")
    if template is None:
        with open(os.path.join(hf_dir, "chat_template.jinja")) as f:
            template = f.read()
    w.add_chat_template(template)


def _copy_tokenizer(w, src: str) -> None:
    """Every `tokenizer.*` metadata entry of GGUF file `src` (vocabulary, merges, special tokens, chat
    template), with its GGUF value types."""
    import gguf
    fields = gguf.GGUFReader(src).fields
    found = [k for k in fields if k.startswith("tokenizer.")]
    if "tokenizer.ggml.tokens" not in found:
        raise ValueError(f"{src}: no tokenizer in the GGUF metadata (tokenizer_from)")
    for key in found:
        f = fields[key]
        w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
