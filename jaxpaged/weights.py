"""Weights: Hugging Face safetensors directories and the engine's orbax format -> the parameter pytree.

One explicit name map per family (they share the Llama names); tensors are read one at a time from
memory-mapped files and written into preallocated stacked arrays, so peak host memory stays near the
size of the output. The pytree layout is documented in `jaxpaged/models/llama.py`.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from jaxpaged.config import ModelConfig

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# HF name (layer part) -> (our name, transpose?)
HF_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
HF_TOP_NAMES = {"model.embed_tokens.weight": ("embed", False), "model.norm.weight": ("final_norm", False),
            "lm_head.weight": ("lm_head", True)}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def param_shapes(cfg: ModelConfig) -> dict:
    """The pytree of shapes the model expects (the contract every loader fills)."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    layers = {"attn_norm": (L, D), "wq": (L, D, q), "wk": (L, D, kv), "wv": (L, D, kv), "wo": (L, q, D),
              "mlp_norm": (L, D), "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
    if cfg.attention_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if cfg.qk_norm:
        layers.update(q_norm=(L, hd), k_norm=(L, hd))
    shapes = {"embed": (V, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def params_from_named_tensors(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype: str,
                              source: str = "checkpoint", progress=None) -> dict:
    """Fill the parameter pytree (numpy, `dtype`) from (HF name, array) pairs, one tensor at a time."""
    np_dtype = NP_DTYPES[dtype]
    shapes = param_shapes(cfg)
    out = {"layers": {k: np.empty(s, np_dtype) for k, s in shapes["layers"].items()}}
    out.update({k: np.empty(s, np_dtype) for k, s in shapes.items() if k != "layers"})
    seen = set()
    for name, arr in tensors:
        m = _LAYER_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if rest.endswith("rotary_emb.inv_freq"):
                continue
            if rest not in HF_LAYER_NAMES or i >= cfg.num_layers:
                raise ValueError(f"{source}: unexpected tensor {name!r} for a {cfg.family} model")
            key, transpose = HF_LAYER_NAMES[rest]
            if key not in out["layers"]:
                raise ValueError(f"{source}: unexpected tensor {name!r} for a {cfg.family} model")
            dst, want, tag = out["layers"][key], shapes["layers"][key][1:], (key, i)
        elif name in HF_TOP_NAMES:
            key, transpose = HF_TOP_NAMES[name]
            if key == "lm_head" and cfg.tie_word_embeddings:
                continue
            dst, want, tag = out, shapes[key], (key, None)
        else:
            raise ValueError(f"{source}: unexpected tensor {name!r} for a {cfg.family} model")
        a = np.asarray(arr)
        a = a.T if transpose else a
        if a.shape != tuple(want):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(np.asarray(arr).shape)}, "
                             f"expected {tuple(want)[::-1] if transpose else tuple(want)}")
        if tag[1] is None:
            out[key] = a.astype(np_dtype)
        else:
            dst[tag[1]] = a.astype(np_dtype)
        seen.add(tag)
        if progress is not None:
            progress.update(1)
    hf_top = {v[0]: k for k, v in HF_TOP_NAMES.items()}
    hf_layer = {v[0]: k for k, v in HF_LAYER_NAMES.items()}
    missing = [hf_top[k] for k in shapes if k != "layers" and (k, None) not in seen]
    missing += [f"model.layers.{i}.{hf_layer[k]}" for k in shapes["layers"] for i in range(cfg.num_layers)
                if (k, i) not in seen]
    if missing:
        raise ValueError(f"{source}: missing tensors: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
    return out


def read_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) from one .safetensors file, memory-mapped; errors name the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than its header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file size {size}")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    base = 8 + n
    for name, info in header.items():
        try:
            dt = _ST_DTYPES[info["dtype"]]
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
        except KeyError as e:
            raise ValueError(f"{path}: tensor {name!r}: unsupported or missing {e}") from None
        if base + end > size:
            raise ValueError(f"{path}: truncated: tensor {name!r} ends at byte {base + end}, file has {size}")
        yield name, mm[base + start: base + end].view(dt).reshape(shape)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: unreadable index ({e})") from None
        paths = [os.path.join(model_dir, f) for f in files]
        for p in paths:
            if not os.path.isfile(p):
                raise ValueError(f"{index}: lists {os.path.basename(p)}, which is missing")
        return paths
    paths = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not paths:
        raise ValueError(f"{model_dir}: no *.safetensors weights found")
    return paths


def count_tensors(cfg: ModelConfig) -> int:
    shapes = param_shapes(cfg)
    return len(shapes) - 1 + len(shapes["layers"]) * cfg.num_layers


def load_hf_params(model_dir: str, cfg: ModelConfig, dtype: str, progress=None) -> dict:
    def tensors():
        for p in safetensors_files(model_dir):
            yield from read_safetensors(p)
    return params_from_named_tensors(cfg, tensors(), dtype, source=model_dir, progress=progress)


ORBAX_SUBDIR = "params"


def is_orbax_dir(model_dir: str) -> bool:
    return os.path.isdir(os.path.join(model_dir, ORBAX_SUBDIR))


def save_orbax_params(params: dict, model_dir: str) -> None:
    import orbax.checkpoint as ocp
    # uncompressed: restoring is then bound by the disk, and saving needs no second copy in memory
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckpt:
        ckpt.save(os.path.abspath(os.path.join(model_dir, ORBAX_SUBDIR)), args=ocp.args.PyTreeSave(params))


def load_orbax_params(model_dir: str, cfg: ModelConfig, dtype: str) -> dict:
    """Restore the pytree as numpy arrays of `dtype` (converted after reading when the file differs)."""
    import orbax.checkpoint as ocp
    path = os.path.abspath(os.path.join(model_dir, ORBAX_SUBDIR))
    try:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(path)
    except Exception as e:  # orbax raises many types; name the directory
        raise ValueError(f"{path}: cannot restore orbax checkpoint ({type(e).__name__}: {e})") from None
    np_dtype = NP_DTYPES[dtype]
    import jax
    shapes = param_shapes(cfg)
    got = jax.tree.map(lambda a: tuple(a.shape), restored)
    if got != jax.tree.map(tuple, shapes, is_leaf=lambda x: isinstance(x, tuple)):
        raise ValueError(f"{path}: parameter shapes do not match config.json")
    return jax.tree.map(lambda a: np.asarray(a).astype(np_dtype, copy=False), restored)


def load_params(model_dir: str, cfg: ModelConfig, dtype: str, progress=None) -> dict:
    """Numpy parameter pytree from an orbax (converted) or Hugging Face directory."""
    if is_orbax_dir(model_dir):
        params = load_orbax_params(model_dir, cfg, dtype)
        if progress is not None:
            progress.update(count_tensors(cfg))
        return params
    return load_hf_params(model_dir, cfg, dtype, progress=progress)
