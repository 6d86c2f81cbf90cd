"""GGUF files -> a Hugging Face config dict, (HF name, array) pairs, and a HF tokenizer.

Everything here follows what transformers' own GGUF loader produces, using its tables and its
tokenizer conversion, but without torch:
- the config comes from the metadata (jaxpaged/checkpoints/gguf_config.py);
- tensors are renamed through gguf's own `TensorNameMap`; an MoE layer's experts, stacked in one GGUF
  tensor [E, out, in] per matrix, become one HF tensor per expert; for the llama architecture (Mistral and
  Mixtral included) the row permutation llama.cpp applies to the Q and K projections (for its interleaved
  RoPE) is undone, as transformers' `LlamaTensorProcessor` does; Gemma's norm scales, stored as 1 + w, lose
  the 1;
- tensors are dequantized by the `gguf` package (`gguf.quants.dequantize`), or kept as their codes
  (jaxpaged/checkpoints/gguf_quant.py) where the type maps onto the engine's quantized format;
- the tokenizer is built by transformers' `convert_gguf_tokenizer` from the GGUF metadata.

Errors are ValueErrors that name the file.
"""
from __future__ import annotations

import os
import re
from typing import Iterator

import numpy as np

from jaxpaged.checkpoints.gguf_config import GGUF_ARCHITECTURES, config_dict
from jaxpaged.checkpoints.gguf_quant import GGUFCodes, gguf_codes, is_packable

_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
_EXPERT = re.compile(r"^(model\.layers\.\d+\..+\.experts)\.\d+\.(.+)\.weight$")


class GGUFModel:
    """One GGUF file, opened and checked (architecture, tensor types, file length) up front."""

    def __init__(self, path: str):
        import gguf
        self.path = path
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file")
        try:
            reader = gguf.GGUFReader(path)
        except ValueError as e:
            if "GGMLQuantizationType" in str(e):
                raise ValueError(f"{path}: unsupported GGUF tensor type ({e})") from None
            raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from None
        except Exception as e:  # a damaged header fails in many ways inside the reader
            raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt "
                             f"({type(e).__name__}: {e})") from None
        self.reader = reader
        self.metadata = {k: f.contents() for k, f in reader.fields.items()}
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"{path}: unsupported GGUF architecture {self.arch!r}; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        size = os.path.getsize(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"{path}: truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes}, file has {size}")
        self._check_types()
        self.config = config_dict(path, self.arch, self.metadata, {t.name for t in reader.tensors})
        self._names = self._hf_names()

    def _check_types(self) -> None:
        """Refuse, before any work, a tensor type the gguf package cannot dequantize."""
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize
        seen = set()
        for t in self.reader.tensors:
            if t.tensor_type in seen:
                continue
            seen.add(t.tensor_type)
            try:
                dequantize(np.zeros((1, GGML_QUANT_SIZES[t.tensor_type][1]), np.uint8), t.tensor_type)
            except NotImplementedError:
                raise ValueError(f"{self.path}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, "
                                 f"which is not supported (the gguf package cannot dequantize it)") from None

    def _hf_names(self) -> dict[str, str]:
        """GGUF tensor name -> HF name, through gguf's TensorNameMap (what transformers uses too)."""
        import gguf

        from jaxpaged.checkpoints.weights import HF_TOP_NAMES, expected_hf_names, layer_name_map
        from jaxpaged.config import ModelConfig
        arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[self.arch]
        n_layers = self.config["num_hidden_layers"]
        name_map = gguf.get_tensor_name_map(arch_enum, n_layers)
        cfg = ModelConfig.from_hf_dict(self.config, source=self.path)
        hf_names = list(HF_TOP_NAMES) + [f"model.layers.{i}.{k}" for i in range(n_layers) for k in layer_name_map(cfg)]
        out = {}
        for hf in hf_names:
            base, suffix = hf.rsplit(".", 1)
            g = name_map.get_name(base)
            if g is not None:
                out[f"{g}.{suffix}"] = hf
        for hf in expected_hf_names(cfg):  # experts: one GGUF tensor per layer and matrix, all experts
            m = _EXPERT.match(hf)
            g = m and name_map.get_name(f"{m.group(1)}.{m.group(2)}")
            if g is not None:
                out[f"{g}.weight"] = f"{m.group(1)}.{{}}.{m.group(2)}.weight"
        return out

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def hf_name(self, gguf_name: str) -> str:
        """The HF name of a GGUF tensor (an expert stack's has `{}` for the expert); ValueError naming the
        file when the model has no such tensor."""
        hf = self._names.get(gguf_name)
        if hf is None:
            raise ValueError(f"{self.path}: tensor {gguf_name!r} has no counterpart in a "
                             f"{self.config['architectures'][0]} model")
        return hf

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array in HF [out, in] layout), dequantized one tensor at a time."""
        return self.raw_tensors(keep_quantized=False)

    def raw_tensors(self, keep_quantized: bool = True) -> Iterator[tuple[str, np.ndarray | GGUFCodes]]:
        """(HF name, tensor) one at a time: with keep_quantized a matrix of a type with a quantized mapping
        as its codes (`GGUFCodes`, W [in, out]: the HF matrix transposed), anything else as a float32
        array in HF [out, in] layout."""
        from gguf.quants import dequantize
        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        for t in self.reader.tensors:
            hf = self.hf_name(t.name)
            n_head = (heads if ".attn_q." in t.name else kv_heads if ".attn_k." in t.name else 0) \
                if self.arch == "llama" else 0
            if keep_quantized and is_packable(t.tensor_type.name) and len(t.shape) >= 2:
                shape = [int(d) for d in reversed(t.shape)]  # [(E,) out, in]
                c = gguf_codes(t.data.reshape(-1, t.data.shape[-1]), t.tensor_type.name, shape[-1])
                if n_head:
                    c = c.columns(_unpermute(np.arange(shape[-2]), n_head))
                parts = [c] if len(shape) == 2 else [c.columns(slice(e * shape[-2], (e + 1) * shape[-2]))
                                                     for e in range(shape[0])]
            else:
                w = dequantize(t.data, t.tensor_type)
                if n_head:
                    w = _unpermute(w, n_head)
                elif self.arch in ("gemma2", "gemma3") and t.name.endswith("norm.weight"):
                    w = w - 1  # llama.cpp stores Gemma's (1 + w) norm scales with the 1 added
                parts = [w] if "{}" not in hf else list(w)
            if "{}" in hf:  # experts [E, out, in]
                yield from ((hf.format(e), p) for e, p in enumerate(parts))
            else:
                yield hf, parts[0]

    def tokenizer(self):
        """The HF fast tokenizer transformers builds from this file's metadata (chat template included)."""
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        meta = self.metadata
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{self.path}: no tokenizer in the GGUF metadata")
        tok_dict, tok_config = ({name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                                 if f"tokenizer.{key}" in meta}
                                for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"],
                                                GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
        if tok_dict.get("tokenizer_type") == "llama":
            tok_config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
        for name, key in _SPECIAL_TOKENS.items():
            token_id = meta.get(f"tokenizer.ggml.{key}")
            tok_config[name] = tok_dict["tokens"][token_id] if token_id is not None else None
        try:
            backend, extra = convert_gguf_tokenizer(self.arch, tok_dict)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{self.path}: cannot build the tokenizer ({e})") from None
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows (head, pair, 2) -> (head, 2, pair)."""
    pair = w.shape[0] // n_head // 2
    return w.reshape(n_head, pair, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
