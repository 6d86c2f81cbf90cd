"""Hugging Face PEFT LoRA adapters -> host arrays in the slot layout, every check at load.

A PEFT directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, bias, ...) and
`adapter_model.safetensors` with, per adapted module, `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]; the module computes W x + scaling * B A x, scaling = alpha / r
(alpha / sqrt(r) with rsLoRA).

The host form of an adapter (`HostAdapter`, numpy, engine dtype; R = max_lora_rank):
    a[leaf] [L, in, R] = A^T zero-padded; b[leaf] [L, R, out] = scaling * B^T zero-padded
for every target leaf of the model (`lora_targets`), zeros where the adapter does not reach. Phi-3's
fused qkv_proj / gate_up_proj adapters split like the base: A is shared, B's rows are cut at the same
places as the fused weight's.
Whatever we do not support is a ValueError naming it: modules_to_save, DoRA, biases, embedding or
lm_head adapters, rank or alpha patterns, r > max_lora_rank, a module the model lacks, a bad shape.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from jaxpaged.checkpoints.weights import NP_DTYPES, param_shapes, read_safetensors
from jaxpaged.config import ModelConfig

ATTENTION = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
MLP = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_TENSOR_RE = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                        r"\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class HostAdapter:
    """One adapter in the slot layout (numpy): a[leaf] [L, in, R], b[leaf] [L, R, out] (scaled)."""
    a: dict
    b: dict
    scaling: float  # of the adapter's config, applied to b already (update_lora's PEFT-named weights too)
    rank: int       # of the adapter's config: what update_lora's PEFT-named weights must have

    def nbytes(self) -> int:
        return sum(x.nbytes for d in (self.a, self.b) for x in d.values())


def lora_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The layer leaves an adapter may reach: q/k/v/o, and gate/up/down unless the MLP has experts."""
    return tuple(ATTENTION.values()) + (() if cfg.num_experts else tuple(MLP.values()))


def module_map(cfg: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """HF module name -> [(leaf, first, last) rows of its B]: Phi-3's fused modules cut like the base."""
    shapes = param_shapes(cfg)["layers"]
    names = {**ATTENTION, **({} if cfg.num_experts else MLP)}
    out = {m: [(leaf, 0, shapes[leaf][-1])] for m, leaf in names.items()}
    if cfg.family == "phi3":
        q, kv, f = shapes["wq"][-1], shapes["wk"][-1], shapes["w_gate"][-1]
        for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            del out[m]
        out["qkv_proj"] = [("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, q + 2 * kv)]
        out["gate_up_proj"] = [("w_gate", 0, f), ("w_up", f, 2 * f)]
    return out


def _json_object(file: str) -> dict:
    """The JSON object in `file`; a ValueError naming the file and what is wrong with it (unreadable, empty,
    not UTF-8, not JSON: where, not an object)."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except OSError as e:
        raise ValueError(f"LoRA adapter {file}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"LoRA adapter {file}: is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise ValueError(f"LoRA adapter {file}: is empty (it must hold a JSON object)")
    try:
        c = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {file}: is not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno})") from None
    if not isinstance(c, dict):
        raise ValueError(f"LoRA adapter {file}: must hold a JSON object, got {type(c).__name__}")
    return c


def read_config(path: str, cfg: ModelConfig, max_lora_rank: int) -> tuple[int, float]:
    """Check `adapter_config.json` in PEFT directory `path`; return (r, scaling)."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json (not a PEFT adapter directory)")
    c = _json_object(file)
    bad = lambda what: ValueError(f"LoRA adapter {file}: {what} is not supported")  # noqa: E731
    if c.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {c['peft_type']!r} (only LORA)")
    if c.get("use_dora"):  # vLLM's words for these two and the rank
        raise ValueError(f"LoRA adapter {file}: does not yet support DoRA (use_dora is true)")
    if c.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {file}: only supports modules_to_save being None, got "
                         f"{c['modules_to_save']!r}")
    if c.get("bias", "none") != "none":
        raise bad(f"bias {c['bias']!r} (only 'none')")
    for key in ("rank_pattern", "alpha_pattern"):
        if c.get(key):
            raise bad(f"{key} {c[key]!r}")
    r, alpha = c.get("r"), c.get("lora_alpha", c.get("r"))
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA adapter {file}: r must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"LoRA adapter {file}: LoRA rank {r} is greater than max_lora_rank {max_lora_rank}")
    targets = c.get("target_modules") or []
    if isinstance(targets, list):  # a string is a regex over module names: the tensors decide
        known = module_map(cfg)
        for t in targets:
            if t not in known:
                raise ValueError(f"LoRA adapter {file}: target module {t!r} is not supported on this "
                                 f"{cfg.family} model (supported: {sorted(known)})")
    return r, alpha / (math.sqrt(r) if c.get("use_rslora") else r)


def host_adapter(cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], r: int, scaling: float,
                 max_lora_rank: int, dtype: str, source: str) -> HostAdapter:
    """PEFT-named (name, array) pairs -> HostAdapter; ValueError naming `source` and the tensor."""
    L, R = cfg.num_layers, max_lora_rank
    shapes = param_shapes(cfg)["layers"]
    targets, modules = lora_targets(cfg), module_map(cfg)
    a = {t: np.zeros((L, shapes[t][-2], R), np.float32) for t in targets}  # [L, in, R]
    b = {t: np.zeros((L, R, shapes[t][-1]), np.float32) for t in targets}  # [L, R, out]
    for name, x in tensors:
        m = _TENSOR_RE.match(name)
        if m is None:
            what = ("an embedding adapter" if "lora_embedding" in name else "DoRA" if "magnitude" in name
                    else "an lm_head adapter" if "lm_head" in name else "a bias" if name.endswith(".bias")
                    else "not a LoRA A/B tensor of a decoder layer")
            raise ValueError(f"LoRA adapter {source}: tensor {name!r} is not supported ({what})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in modules:
            raise ValueError(f"LoRA adapter {source}: tensor {name!r}: the {cfg.family} model has no "
                             f"target module {module!r} (supported: {sorted(modules)})")
        if layer >= L:
            raise ValueError(f"LoRA adapter {source}: tensor {name!r}: layer {layer} >= num_layers ({L})")
        x = np.asarray(x, np.float32)
        parts = modules[module]
        leaf0 = parts[0][0]
        want = (r, shapes[leaf0][-2]) if which == "A" else (parts[-1][2], r)
        if x.shape != want:
            raise ValueError(f"LoRA adapter {source}: tensor {name!r} has shape {list(x.shape)}, the model "
                             f"needs {list(want)} (r={r})")
        for leaf, lo, hi in parts:
            if which == "A":
                a[leaf][layer, :, :r] = x.T
            else:
                b[leaf][layer, :r, :] = scaling * x[lo:hi].T
    np_dtype = NP_DTYPES[dtype]
    return HostAdapter({t: v.astype(np_dtype) for t, v in a.items()},
                       {t: v.astype(np_dtype) for t, v in b.items()}, scaling, r)


def load_peft(path: str, cfg: ModelConfig, max_lora_rank: int, dtype: str) -> HostAdapter:
    """Read and check a PEFT LoRA directory (safetensors only); ValueError naming what is wrong."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    r, scaling = read_config(path, cfg, max_lora_rank)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise ValueError(f"LoRA adapter {path!r}: adapter_model.bin (a PyTorch pickle) is not supported; "
                             "save it with safe_serialization=True (adapter_model.safetensors)")
        raise ValueError(f"LoRA adapter {path!r}: no adapter_model.safetensors")
    return host_adapter(cfg, read_safetensors(file), r, scaling, max_lora_rank, dtype, file)
