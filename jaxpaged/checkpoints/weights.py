"""Weights: Hugging Face safetensors directories and the engine's orbax format -> the parameter pytree.

One explicit name map per family (they share the Llama names); tensors are read one at a time from
memory-mapped files and written into preallocated stacked arrays, so peak host memory stays near the
size of the output. The pytree layout is documented in `jaxpaged/models/llama.py`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import struct
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.models.qarray import (
    FORMATS,
    QArray,
    check_quantization,
    group_of,
    quantize,
    restored,
    symmetric_of,
    zero_code,
)
from jaxpaged.models.quant import convert_leaf, is_quantized_tree, leaf_axis, leaf_format

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# HF name (layer part) -> (our name, transpose?): the Llama map, which every family starts from
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
# Gemma 2/3: post_attention_layernorm follows attention; the MLP has a norm on each side
_GEMMA_LAYER_NAMES = {**HF_LAYER_NAMES, "post_attention_layernorm.weight": ("post_attn_norm", False),
                      "pre_feedforward_layernorm.weight": ("mlp_norm", False),
                      "post_feedforward_layernorm.weight": ("post_mlp_norm", False)}
# MoE: the router, and each expert's matrices (HF expert name -> ours; stacked on the E axis)
_MOE_ROUTER = {"mixtral": "block_sparse_moe.gate.weight", "qwen3_moe": "mlp.gate.weight", "olmoe": "mlp.gate.weight"}
_EXPERT_NAMES = {"w1.weight": "w_gate", "w3.weight": "w_up", "w2.weight": "w_down",
                 "gate_proj.weight": "w_gate", "up_proj.weight": "w_up", "down_proj.weight": "w_down"}
_EXPERT_PREFIX = {"mixtral": "block_sparse_moe.experts", "qwen3_moe": "mlp.experts", "olmoe": "mlp.experts"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(.+)$")


def layer_name_map(cfg: ModelConfig) -> dict[str, list[tuple[str, bool, tuple[int, int] | None]]]:
    """HF layer tensor name -> [(our name, transpose?, (first, last) rows of the HF tensor or None)].

    Phi-3's fused qkv_proj and gate_up_proj are split by rows at load; expert tensors are not listed
    (see `_EXPERT_NAMES`)."""
    base = _GEMMA_LAYER_NAMES if cfg.family in ("gemma2", "gemma3") else HF_LAYER_NAMES
    out = {k: [(name, t, None)] for k, (name, t) in base.items()}
    if cfg.family == "phi3":
        q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight"):
            del out[k]
        out["self_attn.qkv_proj.weight"] = [("wq", True, (0, q)), ("wk", True, (q, q + kv)),
                                            ("wv", True, (q + kv, q + 2 * kv))]
        out["mlp.gate_up_proj.weight"] = [("w_gate", True, (0, f)), ("w_up", True, (f, 2 * f))]
    if cfg.num_experts:
        for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del out[k]
        out[_MOE_ROUTER[cfg.family]] = [("router", True, None)]
    return out


def expected_hf_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor name a checkpoint of this config holds (what the loaders must see)."""
    shapes = param_shapes(cfg)
    names = [k for k, (ours, _) in HF_TOP_NAMES.items() if ours in shapes]
    per_layer = [k for k, dst in layer_name_map(cfg).items() if all(d[0] in shapes["layers"] for d in dst)]
    if cfg.num_experts:
        hf = {"mixtral": ("w1", "w3", "w2")}.get(cfg.family, ("gate_proj", "up_proj", "down_proj"))
        per_layer += [f"{_EXPERT_PREFIX[cfg.family]}.{e}.{n}.weight" for e in range(cfg.num_experts) for n in hf]
    return names + [f"model.layers.{i}.{k}" for i in range(cfg.num_layers) for k in per_layer]


def param_shapes(cfg: ModelConfig) -> dict:
    """The pytree of shapes the model expects (the contract every loader fills)."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    layers = {"attn_norm": (L, D), "wq": (L, D, q), "wk": (L, D, kv), "wv": (L, D, kv), "wo": (L, q, D),
              "mlp_norm": (L, D)}
    if cfg.num_experts:
        E, Fe = cfg.num_experts, cfg.moe_intermediate_size
        layers.update(router=(L, D, E), w_gate=(L, E, D, Fe), w_up=(L, E, D, Fe), w_down=(L, E, Fe, D))
    else:
        layers.update(w_gate=(L, D, F), w_up=(L, D, F), w_down=(L, F, D))
    if cfg.attention_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if cfg.qk_norm == "head":
        layers.update(q_norm=(L, hd), k_norm=(L, hd))
    elif cfg.qk_norm == "flat":
        layers.update(q_norm=(L, q), k_norm=(L, kv))
    if cfg.sandwich_norms:
        layers.update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
    shapes = {"embed": (V, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def empty_params(cfg: ModelConfig, dtype: str, quantization: str | None = None, alloc=np.empty,
                 group_size: int | None = None, symmetric: bool | None = None) -> dict:
    """The preallocated parameter pytree: numpy arrays of `dtype`, and for `quantization` its matrices
    as QArrays (q in the format's storage type, scales float32 with one entry per group of `group_size` on
    the reduced axis, and a minimum shaped like them unless `symmetric`: `quant.leaf_format`).
    `alloc(shape, dtype)` makes each leaf (e.g. `jax.ShapeDtypeStruct` for an abstract model)."""
    np_dtype = NP_DTYPES[dtype]
    check_quantization(quantization)

    def leaf(path, shape):
        axis = leaf_axis(path) if quantization else None
        if axis is None:
            return alloc(shape, np_dtype)
        fmt, group, sym = _leaf_format(path, quantization, group_size, symmetric)
        sshape = list(shape)
        sshape[axis] = -(-shape[axis] // group) if group else 1
        store, _, bits = FORMATS[fmt]
        m = None if sym else alloc(tuple(sshape), np.dtype(np.float32))
        return QArray(alloc(shape, store), alloc(tuple(sshape), np.dtype(np.float32)), dtype, m, group, bits,
                      zero_code(fmt, sym))
    shapes = param_shapes(cfg)
    out = {k: leaf((k,), s) for k, s in shapes.items() if k != "layers"}
    out["layers"] = {k: leaf(("layers", k), s) for k, s in shapes["layers"].items()}
    return out


def _leaf_format(path: tuple[str, ...], quantization: str | None, group_size: int | None,
                 symmetric: bool | None) -> tuple[str | None, int, bool]:
    """(format, group, symmetric) of one leaf under a load's `quantization` settings (their defaults
    resolved: `group_of`, `symmetric_of`)."""
    if not quantization:
        return leaf_format(path, None, 0)
    return leaf_format(path, quantization, group_of(quantization, group_size), symmetric_of(quantization, symmetric))


def map_named_tensors(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], source: str = "checkpoint"):
    """(HF name, array) pairs -> (HF name, [(in layers?, our name, index, part), ...]) by the family's name
    map: `part` (transposed, Phi-3's fused rows split) goes to `params[our name][index]` (index () for
    top-level tensors, (layer,) or (layer, expert) in `params["layers"]`). Tensors the model does not use
    (RoPE inv_freq, a tied lm_head) are skipped; an unknown name or a wrong shape raises ValueError naming
    the tensor."""
    shapes = param_shapes(cfg)
    names = layer_name_map(cfg)
    expected = set(expected_hf_names(cfg))

    def unexpected():
        return ValueError(f"{source}: unexpected tensor {name!r} for a {cfg.family} model")

    for name, arr in tensors:
        a = np.asarray(arr)
        m = _LAYER_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if rest.endswith("rotary_emb.inv_freq"):
                continue
            e = _EXPERT_RE.match(rest) if cfg.num_experts else None
            if e:  # one expert's matrix: into [i, expert]
                dests = [(_EXPERT_NAMES.get(e.group(2)), True, None)]
                where = (i, int(e.group(1)))
            else:
                dests, where = names.get(rest, [(None, False, None)]), (i,)
        elif name in HF_TOP_NAMES:
            dests, where = [HF_TOP_NAMES[name] + (None,)], ()
            if dests[0][0] == "lm_head" and cfg.tie_word_embeddings:
                continue
        else:
            raise unexpected()
        if name not in expected:
            raise unexpected()
        parts = []
        for key, transpose, rows in dests:
            part = a if rows is None else a[rows[0]:rows[1]]
            part = part.T if transpose else part
            want = (shapes["layers"][key] if m else shapes[key])[len(where):]
            if part.shape != tuple(want):
                got = a.shape if rows is None else (a.shape, f"rows {rows[0]}:{rows[1]}")
                raise ValueError(f"{source}: tensor {name!r} has shape {got}, expected "
                                 f"{tuple(want)[::-1] if transpose else tuple(want)}")
            parts.append((bool(m), key, where, part))
        yield name, parts


def params_from_named_tensors(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype: str,
                              source: str = "checkpoint", progress=None, quantization: str | None = None,
                              group_size: int | None = None, symmetric: bool | None = None) -> dict:
    """Fill the parameter pytree (numpy, `dtype`) from (HF name, array) pairs, one tensor at a time;
    with `quantization` ("int8", "int4", "fp8") each matrix is quantized as it arrives, in groups of
    `group_size`, `symmetric` or with a minimum (jaxpaged/models/quant.py)."""
    np_dtype = NP_DTYPES[dtype]
    out = empty_params(cfg, dtype, quantization, group_size=group_size, symmetric=symmetric)
    seen = set()
    for name, parts in map_named_tensors(cfg, tensors, source):
        for in_layers, key, where, part in parts:
            _store(out["layers"] if in_layers else out, key, where, part, np_dtype)
        seen.add(name)
        if progress is not None:
            progress.update(1)
    missing = [n for n in expected_hf_names(cfg) if n not in seen]
    if missing:
        raise ValueError(f"{source}: missing tensors: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
    return out


def _store(tree: dict, key: str, where: tuple, part: np.ndarray, np_dtype) -> None:
    """Write one tensor (part) into tree[key] at index `where` (quantizing it for a QArray leaf)."""
    dst = tree[key]
    if isinstance(dst, QArray):
        qa = quantize(part, dst.format, -1 if key == "embed" else -2, group=dst.group, name=key,
                      symmetric=dst.m is None)
        dst.q[where], dst.scale[where] = qa.q, qa.scale
        if dst.m is not None:
            dst.m[where] = qa.m
    elif where:
        dst[where] = part.astype(np_dtype)
    else:
        tree[key] = part.astype(np_dtype)


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
    return len(expected_hf_names(cfg))


def load_hf_params(model_dir: str, cfg: ModelConfig, dtype: str, progress=None,
                   quantization: str | None = None, group_size: int | None = None,
                   symmetric: bool | None = None) -> dict:
    def tensors():
        for p in safetensors_files(model_dir):
            yield from read_safetensors(p)
    return params_from_named_tensors(cfg, tensors(), dtype, source=model_dir, progress=progress,
                                     quantization=quantization, group_size=group_size, symmetric=symmetric)


ORBAX_SUBDIR = "params"


def is_orbax_dir(model_dir: str) -> bool:
    return os.path.isdir(os.path.join(model_dir, ORBAX_SUBDIR))


def save_orbax_params(params: dict, model_dir: str) -> None:
    """Save the pytree uncompressed under model_dir/params; a QArray as the dict {q, scale, form: int32
    [group, bits, zero]}, with m where it has a minimum (a GGUF matrix kept packed)."""
    import jax
    import orbax.checkpoint as ocp

    def saved(a: QArray) -> dict:
        d = {"q": a.q, "scale": a.scale, "form": np.array([a.group, a.bits, a.zero], np.int32)}
        return d if a.m is None else {**d, "m": a.m}
    params = jax.tree.map(lambda a: saved(a) if isinstance(a, QArray) else a, params,
                          is_leaf=lambda a: isinstance(a, QArray))
    # uncompressed: restoring is then bound by the disk, and saving needs no second copy in memory
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckpt:
        ckpt.save(os.path.abspath(os.path.join(model_dir, ORBAX_SUBDIR)), args=ocp.args.PyTreeSave(params))


def load_orbax_params(model_dir: str, cfg: ModelConfig, dtype: str, quantization: str | None = None,
                      group_size: int | None = None, symmetric: bool | None = None,
                      keep_quantized: bool = False) -> dict:
    """Restore the pytree one leaf at a time as numpy arrays of `dtype`, its matrices in the format
    `quantization` asks for (quantized, widened or re-quantized per leaf: whichever format the
    checkpoint holds, no float32 copy of the whole model is ever made); without `quantization`, the
    checkpoint's quantized matrices stay as saved with `keep_quantized`, else are widened."""
    import jax
    import orbax.checkpoint as ocp
    path = os.path.abspath(os.path.join(model_dir, ORBAX_SUBDIR))
    np_dtype = NP_DTYPES[dtype]
    is_meta = lambda m: hasattr(m, "shape") or is_quantized_tree(m)  # noqa: E731
    try:
        with ocp.PyTreeCheckpointer() as ckpt:
            meta = ckpt.metadata(path).item_metadata.tree
            got = jax.tree.map(lambda m: tuple((m["q"] if isinstance(m, dict) else m).shape), meta,
                               is_leaf=is_meta)
            if got != jax.tree.map(tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)):
                raise ValueError("parameter shapes do not match config.json")

            def restore(keys: tuple, m):
                args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), m)
                item, ra = m, args
                for k in reversed(keys):
                    item, ra = {k: item}, {k: ra}
                r = ckpt.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=ra,
                                                                   partial_restore=True))
                for k in keys:
                    r = r[k]
                axis = leaf_axis(keys)
                if is_quantized_tree(r):
                    try:
                        a = restored(r["q"], r["scale"], axis, r.get("m"), r.get("form"))
                    except ValueError as e:
                        raise ValueError(f"{'/'.join(keys)}: {e}") from None
                    if keep_quantized and quantization is None:
                        return dataclasses.replace(a, dtype=dtype)
                else:
                    a = r
                if axis is None:
                    return np.asarray(a).astype(np_dtype, copy=False)
                return convert_leaf(a, *_leaf_format(keys, quantization, group_size, symmetric), axis, dtype)
            return {k: {n: restore((k, n), mm) for n, mm in m.items()} if k == "layers" else restore((k,), m)
                    for k, m in meta.items()}
    except Exception as e:  # orbax raises many types; name the directory
        raise ValueError(f"{path}: cannot restore orbax checkpoint ({type(e).__name__}: {e})") from None


def load_params(model_dir: str, cfg: ModelConfig, dtype: str, progress=None, quantization: str | None = None,
                group_size: int | None = None, symmetric: bool | None = None, keep_quantized: bool = False) -> dict:
    """Numpy parameter pytree from an orbax (converted) or Hugging Face directory; with `quantization`
    its matrices are QArrays (jaxpaged/models/quant.py) in groups of `group_size`, `symmetric` or not; with
    `keep_quantized` (and no `quantization`) a converted directory's quantized matrices stay QArrays as saved."""
    if is_orbax_dir(model_dir):
        params = load_orbax_params(model_dir, cfg, dtype, quantization, group_size, symmetric, keep_quantized)
        if progress is not None:
            progress.update(count_tensors(cfg))
        return params
    return load_hf_params(model_dir, cfg, dtype, progress=progress, quantization=quantization,
                          group_size=group_size, symmetric=symmetric)


def release_host_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's `malloc_trim`) once the weights are on the device:
    the temporaries of loading one tensor at a time otherwise stay in the resident set (~45 MB for the
    default model). A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
