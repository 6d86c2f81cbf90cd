"""The jit boundary: params and the KV pool on device, scheduler output -> padded arrays -> one step.

Every step has the same shapes except the token count T, padded up to a bucket (powers of two up to
`max_num_batched_tokens`); each bucket (and, with the Pallas backend, a decode-only variant of the
small ones) is compiled ahead of time at start-up, so a running engine never compiles.

The runner owns a mesh (see `jaxpaged/mesh.py`): params sharded by their partition specs, the pools
by KV head, step inputs and outputs replicated; each compiled step donates the pools (updated in place).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.attention import make_attention, resolve_backend
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.mesh import (MODEL_AXIS, POOL_SPEC, REPLICATED, make_mesh, place, place_params,
                           sharded_model_config, vocab_sharded)
from jaxpaged.models.llama import forward
from jaxpaged.sampling import sample
from jaxpaged.scheduler import SchedulerOutput
from jaxpaged.structured import StructuredOutputs

NUM_BANNED = 16  # ids suppressed while a request is below min_tokens (EOS + stop ids)


def token_buckets(max_tokens: int, smallest: int = 8) -> list[int]:
    out, b = [], smallest
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


def _step(params, k_pool, v_pool, batch, sp, *, cfg, attn_fn, num_logprobs, logits_shardings):
    logits, k_pool, v_pool = forward(params, cfg, k_pool, v_pool, batch, attn_fn)
    # vocab-sharded logits (else XLA may gather the lm_head instead), then replicated: the sampler
    # sees the full [S, V] logits on every device, so it draws exactly what one device would
    for sharding in logits_shardings:
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    tokens, tok_lp, top_lp, top_ids = sample(logits, sp, num_logprobs)
    return (tokens, tok_lp, top_lp, top_ids), k_pool, v_pool


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes one KV block takes on each device (K and V, every layer, the device's share of KV heads)."""
    heads = sharded_model_config(cfg, tensor_parallel_size).num_kv_heads // tensor_parallel_size
    return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * jnp.dtype(dtype).itemsize


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, params: dict, num_blocks: int,
                 max_model_len: int, mesh=None, structured: StructuredOutputs | None = None):
        self.mesh = mesh if mesh is not None else make_mesh(cfg.tensor_parallel_size)
        self.tp = self.mesh.shape[MODEL_AXIS]
        self.model_cfg, self.cfg = model_cfg, cfg
        self.step_cfg = sharded_model_config(model_cfg, self.tp)  # KV heads replicated when < tp
        self.dtype = jnp.dtype(cfg.dtype)
        self.num_blocks, self.block_size = num_blocks, cfg.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // cfg.block_size)
        self.backend = resolve_backend(cfg.attention_backend, model_cfg.head_dim, cfg.block_size)
        if cfg.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        self.params = place_params(params, model_cfg, self.mesh)
        self._replicated = NamedSharding(self.mesh, REPLICATED)
        self._pool_sharding = NamedSharding(self.mesh, POOL_SPEC)
        vocab = [NamedSharding(self.mesh, P(None, MODEL_AXIS))] if vocab_sharded(model_cfg, self.tp) else []
        self._logits_shardings = tuple(vocab) + (self._replicated,)
        L, Hkv, hd = model_cfg.num_layers, self.step_cfg.num_kv_heads, model_cfg.head_dim
        pool_shape = (L * num_blocks, cfg.block_size, Hkv, hd)  # [L*N, bs, Hkv, hd], Hkv split over devices
        zeros = jax.jit(lambda: jnp.zeros(pool_shape, self.dtype), out_shardings=self._pool_sharding)
        self.k_pool, self.v_pool = zeros(), zeros()
        self.buckets = token_buckets(cfg.max_num_batched_tokens)
        self.num_logprobs = min(cfg.max_logprobs, model_cfg.vocab_size)
        self._compiled: dict[tuple[int, bool], object] = {}
        self.compile_seconds = 0.0
        S = cfg.max_num_seqs
        # host arrays reused every step
        self._block_tables = np.zeros((S, self.max_blocks_per_seq), np.int32)
        self._row_owner: list = [None] * S          # (request, blocks_epoch) whose blocks row s holds
        self._row_len = [0] * S
        self._history = np.full((S, max_model_len), -1, np.int32)
        # stays on device while no slot uses penalties
        self._no_history = place(self._history, self.mesh, REPLICATED)
        self.structured = structured or StructuredOutputs(None, model_cfg.vocab_size, S)  # grammar masks
        self.structured.all_ones = place(self.structured.all_ones, self.mesh, REPLICATED)  # stays on device

    # -- compilation ----------------------------------------------------------------------
    def variants(self) -> list[tuple[int, bool]]:
        v = [(t, False) for t in self.buckets]
        if self.backend == "pallas":  # decode-only steps use the decode kernel
            v += [(t, True) for t in self.buckets if t <= max(self.cfg.max_num_seqs, self.buckets[0])]
        return v

    @property
    def num_compilations(self) -> int:
        return len(self._compiled)

    def compiled_step(self, key: tuple[int, bool]):
        """The compiled step of bucket `key` = (T, decode_only), compiling it if needed."""
        return self._compiled.get(key) or self._compile(*key)

    def _compile(self, T: int, decode_only: bool):
        fn = functools.partial(_step, cfg=self.step_cfg, num_logprobs=self.num_logprobs,
                               attn_fn=make_attention(self.backend, decode_only, self.mesh),
                               logits_shardings=self._logits_shardings)
        batch, sp = self._device_inputs(*self._dummy(T))
        rep, pool = self._replicated, self._pool_sharding
        params = jax.tree.map(lambda a: a.sharding, self.params)
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=(1, 2), in_shardings=(params, pool, pool, rep, rep),
                           out_shardings=(rep, pool, pool)).lower(
            self.params, self.k_pool, self.v_pool, batch, sp).compile()
        self.compile_seconds += time.perf_counter() - t0
        self._compiled[(T, decode_only)] = compiled
        return compiled

    def warmup(self, show_progress: bool = True) -> None:
        """Compile every step variant now (persistently cached on disk across starts)."""
        todo = [v for v in self.variants() if v not in self._compiled]
        from tqdm.auto import tqdm
        for T, d in tqdm(todo, desc="compiling step buckets", disable=not show_progress, unit="bucket"):
            self._compile(T, d)

    def _dummy(self, T: int):
        S = self.cfg.max_num_seqs
        z = np.zeros
        batch = dict(input_ids=z(T, np.int32), positions=z(T, np.int32), slot_mapping=z(T, np.int32),
                     block_tables=self._block_tables.copy(), seq_lens=z(S, np.int32),
                     query_start_loc=z(S + 1, np.int32), logits_indices=z(S, np.int32))
        return batch, self._sampling_arrays([], S)

    # -- one step -------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens ({self.buckets[-1]})")

    def execute(self, out: SchedulerOutput) -> dict[int, tuple[int, dict | None]]:
        """Run one step; return slot -> (sampled token, {token id: logprob} or None)."""
        S, bs = self.cfg.max_num_seqs, self.block_size
        T = self.bucket_for(out.num_tokens)
        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.zeros(T, np.int32)
        seq_lens = np.zeros(S, np.int32)
        qsl = np.zeros(S + 1, np.int32)
        logits_idx = np.zeros(S, np.int32)
        tables = self._block_tables
        counts = np.zeros(S, np.int32)
        t = 0
        for req, n in out.scheduled:
            s, c, blocks = req.slot, req.num_computed_tokens, req.block_ids
            self._sync_table_row(s, req)
            if n == 1:  # decode: scalars are cheaper than small arrays
                input_ids[t], positions[t] = req.token_ids[c], c
                slot_mapping[t] = blocks[c // bs] * bs + c % bs
            else:
                pos = np.arange(c, c + n, dtype=np.int32)
                input_ids[t:t + n] = req.token_ids[c:c + n]
                positions[t:t + n] = pos
                slot_mapping[t:t + n] = np.asarray(blocks, np.int32)[pos // bs] * bs + pos % bs
            seq_lens[s] = c + n
            counts[s] = n
            logits_idx[s] = t + n - 1
            t += n
        qsl[1:] = np.cumsum(counts)
        batch = dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                     block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl, logits_indices=logits_idx)
        sp = self._sampling_arrays(out.scheduled, S)
        key = (T, self.backend == "pallas" and out.decode_only and T <= max(S, self.buckets[0]))
        batch, sp = self._device_inputs(batch, sp)
        (tokens, tok_lp, top_lp, top_ids), self.k_pool, self.v_pool = self.compiled_step(key)(
            self.params, self.k_pool, self.v_pool, batch, sp)
        tokens = np.asarray(tokens).tolist()
        want_lp = [r for r, _ in out.scheduled if r.params.logprobs is not None]
        if want_lp:
            tok_lp, top_lp, top_ids = np.asarray(tok_lp), np.asarray(top_lp), np.asarray(top_ids)
        result = {}
        for req, _ in out.scheduled:
            s = req.slot
            lp = None
            if req.params.logprobs is not None:
                k = req.params.logprobs
                lp = {int(i): float(v) for i, v in zip(top_ids[s, :k], top_lp[s, :k])}
                lp[tokens[s]] = float(tok_lp[s])
            result[s] = (tokens[s], lp)
        return result

    def _device_inputs(self, batch: dict, sp: dict) -> tuple[dict, dict]:
        """The step's host inputs -> what the compiled step takes, replicated over the mesh.

        Within one process the host arrays go as they are: the compiled call copies them to every device
        of its (replicated) input sharding, ~4x cheaper than `jax.device_put` first. A mesh spanning
        processes needs global arrays, built from each process's identical copy."""
        if self.mesh.is_multi_process:
            return jax.tree.map(lambda a: a if isinstance(a, jax.Array) else place(np.asarray(a), self.mesh,
                                                                                  REPLICATED), (batch, sp))
        return batch, sp

    def memory_per_device(self) -> dict:
        """Bytes of parameters and of the KV pools held by this process's first device of the mesh (read
        from the arrays' shards)."""
        dev = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

        def on_first(arrays):
            return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == dev)
        return dict(param_bytes_per_device=on_first(jax.tree.leaves(self.params)),
                    kv_bytes_per_device=on_first([self.k_pool, self.v_pool]))

    def _sync_table_row(self, s: int, req) -> None:
        """Keep the persistent block-table row of slot s equal to the request's blocks, by difference."""
        owner = (req, req.blocks_epoch)
        n_old, n_new = self._row_len[s], len(req.block_ids)
        if self._row_owner[s] != owner:
            self._block_tables[s, :n_old] = 0
            self._row_owner[s], n_old = owner, 0
        if n_new > n_old:
            self._block_tables[s, n_old:n_new] = req.block_ids[n_old:]
        self._row_len[s] = n_new

    def _sampling_arrays(self, scheduled, S: int) -> dict:
        f32, i32 = np.float32, np.int32
        sp = dict(temperature=np.zeros(S, f32), top_p=np.ones(S, f32), top_k=np.zeros(S, i32),
                  min_p=np.zeros(S, f32), seed=np.zeros(S, np.uint32), gen_index=np.zeros(S, i32),
                  banned=np.full((S, NUM_BANNED), -1, i32), prompt_len=np.zeros(S, i32),
                  history_len=np.zeros(S, i32), presence_penalty=np.zeros(S, f32),
                  frequency_penalty=np.zeros(S, f32), repetition_penalty=np.ones(S, f32))
        any_pen = any_filter = any_lp = False
        all_greedy = True
        for req, _ in scheduled:
            s, p = req.slot, req.params
            sp["temperature"][s] = p.temperature
            sp["top_p"][s], sp["top_k"][s], sp["min_p"][s] = p.top_p, p.top_k, p.min_p
            sp["seed"][s] = req.seed
            sp["gen_index"][s] = req.num_output_tokens
            all_greedy &= p.temperature == 0
            any_lp |= p.logprobs is not None
            any_filter |= p.top_p < 1 or p.top_k > 0 or p.min_p > 0
            if req.num_output_tokens < p.min_tokens:
                ban = ([] if p.ignore_eos else sorted(req.eos_token_ids)) + p.stop_token_ids
                sp["banned"][s, :len(ban)] = ban[:NUM_BANNED]
            if p.uses_penalties:
                any_pen = True
                h = len(req.token_ids)
                self._history[s, :h] = req.token_ids
                sp["prompt_len"][s], sp["history_len"][s] = req.num_prompt_tokens, h
                sp["presence_penalty"][s] = p.presence_penalty
                sp["frequency_penalty"][s] = p.frequency_penalty
                sp["repetition_penalty"][s] = p.repetition_penalty
        sp["history"] = self._history if any_pen else self._no_history
        sp["any_penalty"], sp["any_filter"] = np.bool_(any_pen), np.bool_(any_filter)
        sp["all_greedy"], sp["any_logprobs"] = np.bool_(all_greedy), np.bool_(any_lp)
        sp.update(self.structured.bitmask_arrays(scheduled, S))  # bitmask [S, W], any_mask
        return sp
