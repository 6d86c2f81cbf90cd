"""The step as one pure function, traced once per compiled variant (runner.py compiles and runs it).

The packed host buffer is unpacked by the variant's static layout; tokens still on the device (async
scheduling) replace their placeholders; the decoder runs with the features' arguments (step/features.py);
the variant's `Sampling` draws each advancing slot's tokens (R = min(S, T) rows, scattered back to one
entry per slot); then each feature's outputs, from what the step computed (`features.Traced`).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpaged.config import ModelConfig
from jaxpaged.models.live_rows import live_rows
from jaxpaged.models.llama import decoder, lm_logits
from jaxpaged.step.features import Sampling, Traced, decoded


@dataclass(frozen=True)
class Variant:
    """The static part of one compiled step: what `traced_step` is traced with."""
    layout: tuple          # of the packed buffer (core/batch.py)
    cfg: ModelConfig       # the step's (sharded) model config
    attn_fn: object
    logits_shardings: tuple
    sampling: Sampling     # how the step draws each slot's tokens (plain, or verifying proposals)
    features: tuple        # StepFeatures (step/features.py), in the runner's order


def unpack(packed, layout) -> tuple[dict, dict]:
    """The packed int32 buffer -> (batch, sampling) dicts, by the static `batch.layout`."""
    out = ({}, {})
    for which, name, shape, dtype, start, size in layout:
        a = packed[start:start + size].reshape(shape)
        if dtype == "bool":
            a = a != 0
        elif dtype != "int32":
            a = jax.lax.bitcast_convert_type(a, jnp.dtype(dtype))
        out[which][name] = a
    return out


def traced_step(params, k_pool, v_pool, packed, extra, *, variant: Variant):
    """(params, pools, the packed host buffer i32[N], the separate inputs {name: array}) -> ((the sampled
    tokens and logprobs per slot, each feature's outputs), k_pool, v_pool); the pools are donated."""
    batch, sp = unpack(packed, variant.layout)
    extra = dict(extra)
    prev = batch.pop("prev_index")  # [T]: tokens still on the device, taken from the previous step's output
    batch["input_ids"] = jnp.where(prev >= 0, extra.pop("prev_tokens")[jnp.maximum(prev, 0)], batch["input_ids"])
    sp.update(extra)
    args = {k: v for f in variant.features for k, v in f.decoder_args(batch, sp).items()}
    with live_rows(batch["query_start_loc"][-1]):  # rows [0, tokens) are the step's; the rest pad the bucket
        h, k_pool, v_pool, *outs = decoder(params, variant.cfg, k_pool, v_pool, batch, variant.attn_fn, **args)

    def logits_of(hidden):  # [N, D] -> [N, V]
        logits = lm_logits(params, variant.cfg, hidden)
        # vocab-sharded logits (else XLA may gather the lm_head instead), then replicated: the sampler
        # sees the full [N, V] logits on every device, so it draws exactly what one device would
        for sharding in variant.logits_shardings:
            logits = jax.lax.with_sharding_constraint(logits, sharding)
        return logits
    # logits and sampling only for the R = min(S, T) rows of the slots this step advances: a step of a
    # few requests does not pay for S rows of lm_head and sampler (a lone request, 256 slots: 5.6x a step)
    S, rows = batch["logits_indices"].shape[0], batch["sample_slots"]  # rows i32[R]: slots, then S (padding)
    drawn = variant.sampling.draw(logits_of, h, batch, sp)  # [R, ...] each
    sampled = tuple(jnp.zeros((S,) + a.shape[1:], a.dtype).at[rows].set(a, mode="drop")
                    for a in drawn)  # back to one entry per slot
    traced = Traced(batch, sp, h, decoded(args, outs), logits_of, variant.sampling.token_rows(batch))
    return (sampled, tuple(f.outputs(traced) for f in variant.features)), k_pool, v_pool
