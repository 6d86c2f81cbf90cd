"""The draft-model proposer: a second (small) model that proposes k tokens per request and step.

It has its own parameters (loaded like the target's, placed on the target's mesh) and its own KV pool of
the same block size and number of blocks, addressed through the target's block tables: a block id means
the same positions of the same request in both pools. After the scheduler has scheduled the step (the
proposals still placeholders, `propose`), `fill` runs one jitted function:

1. catch-up: the draft runs the target's very chunk of this step (prefill chunks and each decoding
   request's last token; the placeholder rows are rewritten below), so the draft has K/V wherever the
   target computes them, prefix-cache blocks included, and a request's draft K/V are valid up to its
   `num_computed_tokens`, which is the draft's computed length: positions past it (rejected proposals)
   are rewritten by the next chunk before they are read;
2. proposal: a fixed loop of k steps of one row per slot: draw d_i from the draft's distribution q_i
   (the request's temperature / top-k / top-p / min-p and `min_tokens` bans applied; the plain
   sampler's key for that position, so a seeded request is reproducible), then feed d_i at its position.
   Feeding d_k too leaves the draft's K/V valid over every accepted token.

The proposals come back to the host (the target schedules them as input tokens) with q on the device,
which the verifier takes as `draft_probs` (rejection.py). A draft head (EAGLE, MTP) would be another
proposer with the same `propose` / `fill` / `retain`; the verifier only sees tokens and q.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpaged.config import ModelConfig
from jaxpaged.core.batch import PersistentBatch
from jaxpaged.models.llama import decoder, lm_logits
from jaxpaged.spec_decode.step import draft_inputs
from jaxpaged.step import kv_cache
from jaxpaged.step.attention import make_attention, resolve_backend
from jaxpaged.step.mesh import POOL_SPEC, REPLICATED, place_params, sharded_model_config
from jaxpaged.step.sampler import controlled_logits, processed_logits, sample

_SAMPLER_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "gen_index", "banned", "any_filter",
                 "all_greedy")


def check_draft(model_dir, target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig; ValueError naming `speculative_config.model` when the directory is missing
    or the draft's vocabulary is not the target's (the engine checks this before loading anything)."""
    if not isinstance(model_dir, str) or not os.path.isdir(model_dir):
        raise ValueError(f"speculative_config.model {model_dir!r} is not a model directory")
    mc = ModelConfig.from_dir(model_dir)
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {model_dir!r} has vocab_size {mc.vocab_size}; the target's "
                         f"is {target.vocab_size} (a draft must share the target's vocabulary)")
    return mc


def _draft_sp(sp: dict, i, min_tokens, vocab_size: int) -> dict:
    """The sampler's inputs for proposal position i (0-based) of every slot: its own key index, bans while
    below min_tokens; no logit controls, penalties or masks (q need not be the target's: any q is exact)."""
    S = sp["seed"].shape[0]
    gen = sp["gen_index"] + i                                            # [S]
    return dict({k: sp[k] for k in _SAMPLER_KEYS}, gen_index=gen,
                banned=jnp.where((gen < min_tokens)[:, None], sp["banned"], -1),
                bitmask=jnp.full((S, -(-vocab_size // 32)), -1, jnp.int32),       # all ones: no mask
                bias_ids=jnp.full((S, 1), -1, jnp.int32), bias_values=jnp.zeros((S, 1), jnp.float32),
                history=jnp.zeros((S, 1), jnp.int32),
                prompt_len=jnp.zeros(S, jnp.int32), history_len=jnp.zeros(S, jnp.int32),
                presence_penalty=jnp.zeros(S), frequency_penalty=jnp.zeros(S), repetition_penalty=jnp.ones(S),
                any_penalty=False, any_mask=False, any_bias=False, any_logprobs=False)


def _propose(params, k_pool, v_pool, batch, sp, *, cfg, attn_fn, num_spec: int, block_size: int):
    """Catch up on the step's chunk, then draw and feed num_spec proposals per slot.

    batch: the target's step arrays (input_ids i32[T] .. logits_indices i32[S]) plus num_drafts i32[S]
    and min_tokens i32[S]; sp: the target's per-slot sampling arrays. Returns (tokens i32[S, K],
    q f32[S, K, V], k_pool, v_pool); rows of slots without proposals are don't-cares."""
    S = batch["seq_lens"].shape[0]
    nd = batch["num_drafts"]                                             # [S]
    keys = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    h, k_pool, v_pool = decoder(params, cfg, k_pool, v_pool, {k: batch[k] for k in keys}, attn_fn)
    logits = lm_logits(params, cfg, h[batch["logits_indices"] - nd])   # [S, V] at each slot's last token
    last = batch["seq_lens"] - nd - 1                                   # [S] the last token's position
    tables, slots = batch["block_tables"], jnp.arange(S)

    def step(carry, i):  # draw d_(i+1) from the logits, then feed it at last + 1 + i
        logits, k_pool, v_pool = carry
        psp = _draft_sp(sp, i, batch["min_tokens"], logits.shape[-1])
        q = jax.nn.softmax(processed_logits(controlled_logits(logits, psp), psp), axis=-1)  # [S, V]
        d = sample(logits, psp, 1)[0]                                   # [S], drawn from q
        pos = last + 1 + i
        live = i < nd                                                   # past a slot's proposals: null block
        row = {"input_ids": d, "positions": jnp.where(live, pos, 0), "block_tables": tables,
               "slot_mapping": jnp.where(live, tables[slots, jnp.clip(pos // block_size, 0, tables.shape[1] - 1)]
                                         * block_size + pos % block_size, 0),
               "seq_lens": jnp.where(live, pos + 1, 1), "query_start_loc": jnp.arange(S + 1, dtype=jnp.int32)}
        h, k_pool, v_pool = decoder(params, cfg, k_pool, v_pool, row, attn_fn)
        return (lm_logits(params, cfg, h), k_pool, v_pool), (d, q)

    def loop(args):
        (_, kp, vp), (d, q) = jax.lax.scan(step, args, jnp.arange(num_spec))
        return d.T.astype(jnp.int32), jnp.swapaxes(q, 0, 1), kp, vp     # [S, K], [S, K, V]

    def skip(args):
        _, kp, vp = args
        return (jnp.zeros((S, num_spec), jnp.int32), jnp.zeros((S, num_spec, logits.shape[-1]), jnp.float32),
                kp, vp)
    return jax.lax.cond(nd.any(), loop, skip, (logits, k_pool, v_pool))


class DraftModelProposer:
    """Proposals from a draft model, run on the runner's mesh beside the target (module docstring)."""

    def __init__(self, model_dir: str, runner, num_spec: int):
        cfg = runner.cfg
        self.runner, self.k = runner, num_spec
        from jaxpaged.checkpoints.weights import load_params
        self.model_config = check_draft(model_dir, runner.model_cfg)
        params = load_params(model_dir, self.model_config, cfg.dtype, quantization=cfg.quantization,
                             group_size=cfg.quantization_group_size, symmetric=cfg.quantization_symmetric)
        mesh = runner.mesh
        self.params = place_params(params, self.model_config, mesh)
        del params
        step_cfg = sharded_model_config(self.model_config, runner.tp)
        shape = (self.model_config.num_layers * runner.num_blocks, runner.block_size, step_cfg.num_kv_heads,
                 self.model_config.head_dim)                            # [L*N, bs, Hkv, hd], as the target's
        pool, rep = NamedSharding(mesh, POOL_SPEC), NamedSharding(mesh, REPLICATED)
        zeros = jax.jit(lambda: kv_cache.zeros_pool(shape, "auto", runner.dtype), out_shardings=pool)
        self.k_pool, self.v_pool = zeros(), zeros()
        backend = resolve_backend(cfg.attention_backend, self.model_config.head_dim, runner.block_size,
                                  mesh.devices.flat, dtype=runner.dtype)  # its pool: kv_cache_dtype 'auto'
        params_sharding = jax.tree.map(lambda a: a.sharding, self.params)
        self._fn = jax.jit(functools.partial(_propose, cfg=step_cfg, attn_fn=make_attention(backend, False, mesh),
                                             num_spec=num_spec, block_size=runner.block_size),
                           donate_argnums=(1, 2), in_shardings=(params_sharding, pool, pool, rep, rep),
                           out_shardings=(rep, rep, pool, pool))
        self._compiled: dict[int, object] = {}  # token bucket -> the compiled function (the target's buckets)
        if cfg.warmup:
            for T in runner.buckets:
                self._compiled_for(T)

    def _inputs(self, scheduled, T: int, persistent=None) -> tuple[dict, dict]:
        """The draft's inputs for `scheduled` in a T-token step: the target's step arrays (the persistent
        batch's), each slot's number of proposals and min_tokens, the sampling rows."""
        runner = self.runner
        batch, sp = (persistent or runner.batch).prepare(scheduled, T)
        spec = draft_inputs(scheduled, runner.cfg.max_num_seqs, self.k)
        batch = {k: v for k, v in batch.items() if k not in ("prev_index", "sample_slots")}
        batch.update(num_drafts=spec["num_drafts"], min_tokens=spec["min_tokens"])
        return batch, {k: sp[k] for k in _SAMPLER_KEYS}

    def _compiled_for(self, T: int):
        if T not in self._compiled:
            r = self.runner
            empty = PersistentBatch(r.cfg.max_num_seqs, r.max_blocks_per_seq, 1, r.block_size)
            self._compiled[T] = self._fn.lower(self.params, self.k_pool, self.v_pool,
                                               *self._inputs([], T, empty)).compile(r.compiler_options)
        return self._compiled[T]

    def propose(self, req, k: int) -> list[int]:
        """k placeholders: the scheduler schedules them, `fill` writes the draft's tokens in."""
        return [0] * min(k, self.k)

    def retain(self, request_ids: set) -> None:
        """Nothing per request lives here (the draft's computed length is the request's)."""

    def fill(self, out):
        """Run the draft over a scheduled step: the proposals (`req.spec_token_ids`, as many as the
        scheduler kept) replaced by the draft's; returns q f32[S, K, V] on the device."""
        T = self.runner.bucket_for(out.num_tokens)
        batch, sp = self._inputs(out.scheduled, T)
        tokens, q, self.k_pool, self.v_pool = self._compiled_for(T)(self.params, self.k_pool, self.v_pool, batch, sp)
        if batch["num_drafts"].any():
            tokens = np.asarray(tokens)                                 # [S, K]
            for req, _ in out.scheduled:
                if req.spec_token_ids:
                    req.spec_token_ids = tokens[req.slot, :len(req.spec_token_ids)].tolist()
        return q
