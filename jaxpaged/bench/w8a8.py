"""vLLM's own int8 configuration for the peer runs: a compressed-tensors W8A8 copy of a Hugging Face directory.

vLLM's CPU build runs int8 weights with int8 activations (`CPUInt8ScaledMMLinearKernel`: oneDNN, or its AMX
kernel where the CPU has one) when a checkpoint says so in compressed-tensors' format. No such copy of a
random-weight model exists to download, so the bench writes one: every Linear weight of the decoder layers
(q/k/v/o, gate/up/down) int8, symmetric, one scale per output channel (scale = max|w| / 127, round to nearest);
the activations quantized by vLLM itself, per token, dynamically (its W8A8 "int-quantized" scheme); embeddings,
norms and the (tied) head as they are. The directory is written once next to the model (`<dir>-w8a8`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                        "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }
    },
}


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w float [N, K] (a Linear's out x in) -> (int8 codes [N, K], float32 scales [N, 1]); an all-zero row
    gets scale 1 (codes 0). A NaN or infinity is refused."""
    w = np.asarray(w, np.float32)
    if not np.isfinite(w).all():
        raise ValueError("w8a8: a weight holds NaN or infinity")
    amax = np.abs(w).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS


def w8a8_dir(src: str) -> str:
    """The W8A8 copy of the Hugging Face directory `src` (written once, beside it); its path."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out = os.path.normpath(src) + "-w8a8"
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"w8a8: no *.safetensors in {src}")
    tmp = tempfile.mkdtemp(prefix=".tmp-w8a8-", dir=os.path.dirname(out))
    quantized = 0
    for fname in files:
        tensors = {}
        with safe_open(os.path.join(src, fname), framework="flax") as f:  # flax: bfloat16 reads as is
            for name in f.keys():
                x = np.asarray(f.get_tensor(name).astype("float32"))
                if is_projection(name):
                    tensors[name], tensors[name + "_scale"] = quantize_rows(x)
                    quantized += 1
                else:
                    tensors[name] = x
        save_file(tensors, os.path.join(tmp, fname))
    if not quantized:
        raise ValueError(f"w8a8: no decoder projection ({', '.join(PROJECTIONS)}) in {src}")
    index = "model.safetensors.index.json"
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and os.path.isfile(os.path.join(src, f)) and f not in ("config.json", index):
            shutil.copy2(os.path.join(src, f), tmp)
    if os.path.isfile(os.path.join(src, index)):  # a sharded model: each scale lives in its weight's shard
        with open(os.path.join(src, index)) as f:
            idx = json.load(f)
        idx["weight_map"].update({k + "_scale": v for k, v in idx["weight_map"].items() if is_projection(k)})
        with open(os.path.join(tmp, index), "w") as f:
            json.dump(idx, f, indent=2)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = QUANTIZATION_CONFIG
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    os.rename(tmp, out)
    return out
