"""The engine's whole jitted step compiled for TPU v5e and v6e (libtpu, no TPU needed): every bucket, at
TP = 1, 4 and 8, for the default model's shapes and a Llama-3-8B-shaped config, bf16 and int8 KV.

From each compiled step: `memory_analysis()` (parameters + KV pool + temporaries per chip, against the
chip's HBM) and `cost_analysis()` (flops and HBM bytes per chip), the latter turned into a predicted decode
step time at 1, 64 and 256 running requests: max(flops / bf16 peak, bytes / HBM bandwidth) of the decode
bucket that holds them, plus the K/V those requests read at CONTEXT tokens each (the attention kernel is a
custom call, opaque to XLA's cost model, which counts its whole pool operand instead: that count is taken
out). Predictions, not measurements: scripts/tpu_check.sh measures on a TPU.

    python scripts/tpu_compile_table.py [--out docs/results/tpu_compile.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu_aot  # noqa: E402

MODELS = {  # Hugging Face config fields
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5),
}
ENGINE = dict(dtype="bfloat16", block_size=16, max_num_seqs=256, max_num_batched_tokens=512, max_model_len=4096)
CONTEXT = 1024  # tokens of context each running request reads in the predicted decode step
KV_TOKENS = 256 * CONTEXT  # the pool: 256 requests of CONTEXT tokens (all layers, K and V, split by KV head)
RUNNING = (1, 64, 256)
TPS = (1, 4, 8)
KV_DTYPES = ("bfloat16", "int8")
