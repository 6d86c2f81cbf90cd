"""The jit boundary: params and the KV pool on device, scheduler output -> padded arrays -> one step.

Every step has the same shapes except the token count T, padded up to a bucket (powers of two up to
`max_num_batched_tokens`); each bucket (and, with the Pallas backend, a decode-only variant of the
small ones) is compiled ahead of time at start-up, so a running engine never compiles.

The runner owns a mesh (see `jaxpaged/parallel/mesh.py`): params sharded by their partition specs, the pools
by KV head, step inputs and outputs replicated; each compiled step donates the pools (updated in place).
Its host inputs come from the persistent batch (`jaxpaged/core/batch.py`) and go to the device as one packed
buffer; `launch` starts a step without waiting, `read` waits for its tokens (async scheduling runs the
next `launch` in between).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpaged.step import kv_cache
from jaxpaged.step.attention import DECODE_KERNELS, make_attention, resolve_backend, shard_heads, target_platform
from jaxpaged.step.batch_invariant import ROW_TILE, invariant_attention, row_tiled_sample
from jaxpaged.core.batch import NUM_BANNED, SEPARATE, PersistentBatch, layout, pack  # noqa: F401 -- NUM_BANNED: re-exported
from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.parallel.mesh import (MODEL_AXIS, POOL_SPEC, REPLICATED, SCALE_SPEC, make_mesh, place, place_params,
                           sharded_model_config, vocab_sharded)
from jaxpaged.core.logit_controls import LogitControls
from jaxpaged.models.llama import decoder, lm_logits
from jaxpaged.step.prompt_logprobs import collect, step_prompt_logprobs, targets
from jaxpaged.step.research import SlotHooks, hidden_outputs, read_hidden, step_hooks
from jaxpaged.step import routed_experts
from jaxpaged.step.sampler import sample, slot_rows
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.structured import StructuredOutputs
from jaxpaged.lora.slots import LoRASlots
from jaxpaged.spec_decode.controls import PositionControls
from jaxpaged.spec_decode.positions import verified_hidden
from jaxpaged.spec_decode.step import draft_inputs, read_verified
from jaxpaged.spec_decode.verify import verify_rows



def token_buckets(max_tokens: int, smallest: int = 8) -> list[int]:
    out, b = [], smallest
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


@dataclass
class Launched:
    """A step started on the device: its schedule and its outputs (device arrays, maybe not ready)."""
    out: SchedulerOutput
    slots: list[int]       # of out.scheduled, at launch (a request may leave its slot before the read)
    tokens: jax.Array      # i32[S]
    logprobs: tuple        # token f32[S], top f32[S, K], top ids i32[S, K]
    pending: frozenset = frozenset()  # requests whose token of this step is not on the host yet
    hidden: tuple = ()     # captured states: f32[S, nL, D] at the logits rows, f32[T, nL, D] (research.py)
    hidden_plan: tuple = ()  # what to read back of them (SlotHooks.plan)
    prompt: tuple = ()     # prompt logprobs: next token f32[T], top f32[T, K], top ids i32[T, K]
    prompt_rows: list = field(default_factory=list)  # prompt_logprobs.targets: the requests that asked
    any_logprobs: bool = True  # some scheduled request asked for logprobs (else none are read back)
    routes: object = None  # MoE models: the experts each token was routed to, i32[T, L, k] (routed_experts.py)
    routes_rows: list = field(default_factory=list)  # routed_experts.plan: the requests that asked
    verified: bool = False  # the verifying variant ran (some request proposed): tokens i32[S, K+1]


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


def _step(params, k_pool, v_pool, packed, extra, *, layout, cfg, attn_fn, num_logprobs, logits_shardings,
          logprobs_mode="raw_logprobs", capture=(), steer=(), num_spec=0, routes=False):
    batch, sp = unpack(packed, layout)
    extra = dict(extra)
    prev = batch.pop("prev_index")  # [T]: tokens still on the device, taken from the previous step's output
    batch["input_ids"] = jnp.where(prev >= 0, extra.pop("prev_tokens")[jnp.maximum(prev, 0)], batch["input_ids"])
    sp.update(extra)
    h, k_pool, v_pool, *outs = decoder(params, cfg, k_pool, v_pool, batch, attn_fn, routes=routes,
                                       **step_hooks(sp, batch, capture, steer))
    states, routed = (outs[:-1], outs[-1:]) if routes else (outs, [])  # routed: [i32[T, L, k]] (MoE)
    # logits and sampling only for the R = min(S, T) rows of the slots this step advances: a step of a
    # few requests does not pay for S rows of lm_head and sampler (a lone request, 256 slots: 5.6x a step)
    S, rows = batch["logits_indices"].shape[0], batch["sample_slots"]  # rows i32[R]: slots, then S (padding)
    at = jnp.minimum(rows, S - 1)

    def logits_of(hidden):  # [N, D] -> [N, V]
        logits = lm_logits(params, cfg, hidden)
        # vocab-sharded logits (else XLA may gather the lm_head instead), then replicated: the sampler
        # sees the full [N, V] logits on every device, so it draws exactly what one device would
        for sharding in logits_shardings:
            logits = jax.lax.with_sharding_constraint(logits, sharding)
        return logits
    if num_spec:  # speculative decoding: each slot's proposals verified, [R, K+1] (jaxpaged/spec_decode/verify.py)
        drawn = verify_rows(logits_of, h, batch, sp, num_spec, num_logprobs, logprobs_mode)
    else:
        logits = logits_of(h[batch["logits_indices"][at]])  # [R, V]
        draw = functools.partial(sample, num_logprobs=num_logprobs, logprobs_mode=logprobs_mode)
        if cfg.row_tile:  # batch invariance: the sampler's row reductions over tiles of fixed shape too
            drawn = row_tiled_sample(draw, logits, slot_rows(sp, at, S), cfg.row_tile)
        else:
            drawn = draw(logits, slot_rows(sp, at, S))  # a row's draw depends on its slot's seed only
    tokens, tok_lp, top_lp, top_ids = (jnp.zeros((S,) + a.shape[1:], a.dtype).at[rows].set(a, mode="drop")
                                       for a in drawn)  # back to one entry per slot
    prompt = step_prompt_logprobs(params, cfg, h, batch["prompt_next"], sp["any_prompt_logprobs"], num_logprobs,
                                  logits_shardings)
    hidden = hidden_outputs(states, batch, sp)
    if num_spec and hidden:  # the states of every verified position: [S, K+1, nL, D]
        hidden = (verified_hidden(states[0], batch, num_spec), hidden[1])
    return ((tokens, tok_lp, top_lp, top_ids, *hidden), prompt, *routed), k_pool, v_pool


def _separate(batch: dict, sp: dict) -> dict:
    """The step inputs that travel beside the packed buffer (they may already live on the device)."""
    return {name: d[name] for d in (batch, sp) for name in SEPARATE if name in d}


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype, tensor_parallel_size: int = 1,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes one KV block takes on each device (K and V, every layer, the device's share of KV heads;
    in the kv_cache_dtype, scales included)."""
    heads = sharded_model_config(cfg, tensor_parallel_size).num_kv_heads // tensor_parallel_size
    return 2 * cfg.num_layers * block_size * heads * kv_cache.bytes_per_token_head(kv_cache_dtype, dtype,
                                                                                    cfg.head_dim)


def step_compiler_options(dtype, kv_cache_dtype: str = "auto", platform: str | None = None) -> dict | None:
    """XLA options for compiling the step (and scoring). On CPU, where bfloat16 weights or a bfloat16 KV
    cache are in play, XLA's bf16 float-normalization pass is turned off. It widens every bfloat16
    dynamic-slice and gather to float32: the layer scan converted the whole stacked weights to float32
    (and each layer's slice back) on every step, and attention the whole KV pool (SmolLM2-135M, decode at
    64 running, bfloat16 weights and KV: 862 -> 153 ms a step). The other thing the pass ensures,
    products in float32, every product on CPU already asks for (`quant.dot`, attention in float32).
    `platform`: the target's ('cpu' | 'gpu' | 'tpu'; default: this process's backend)."""
    pool_dtype = kv_cache.storage_dtype(kv_cache_dtype, dtype)
    if (platform or jax.default_backend()) == "cpu" and jnp.bfloat16 in (jnp.dtype(dtype), pool_dtype):
        return {"xla_disable_hlo_passes": "float-normalization-bf16"}
    return None


def _lost(a) -> bool:
    """Whether a device array's contents are gone: deleted, or made by a computation that failed."""
    try:
        if a.is_deleted():
            return True
        a.block_until_ready()  # raises if the computation that made it failed
        return False
    except Exception:  # noqa: BLE001 -- whatever the device reports, the contents are gone
        return True


class ModelRunner:
    """The step's device state and its compiled variants. `abstract=True` (jaxpaged/step/aot.py): `params`
    is a pytree of `jax.ShapeDtypeStruct`s already sharded on `mesh`, nothing is placed on a device, and
    the variants only compile (for any target, compile-only topology devices included)."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, params: dict, num_blocks: int,
                 max_model_len: int, mesh=None, structured: StructuredOutputs | None = None,
                 abstract: bool = False):
        self.mesh = mesh if mesh is not None else make_mesh(cfg.tensor_parallel_size)
        self.abstract = abstract
        self.platform = target_platform(self.mesh.devices.flat)[0]
        self.tp = self.mesh.shape[MODEL_AXIS]
        self.model_cfg, self.cfg = model_cfg, cfg
        self.step_cfg = sharded_model_config(model_cfg, self.tp)  # KV heads replicated when < tp
        if cfg.batch_invariant:  # products over fixed row tiles (jaxpaged/step/batch_invariant.py)
            if model_cfg.num_experts:
                raise ValueError("batch_invariant is not supported for mixture-of-experts models (their expert "
                                 "products run over the step's tokens sorted by expert)")
            self.step_cfg = dataclasses.replace(self.step_cfg, row_tile=ROW_TILE)
        self.dtype = jnp.dtype(cfg.dtype)
        self.num_blocks, self.block_size = num_blocks, cfg.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // cfg.block_size)
        self.backend = resolve_backend(cfg.attention_backend, model_cfg.head_dim, cfg.block_size,
                                       self.mesh.devices.flat)
        if cfg.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        self.params = params if abstract else place_params(params, model_cfg, self.mesh)
        self.lora = LoRASlots(model_cfg, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, cfg.dtype, self.mesh,
                              abstract) if cfg.enable_lora else None
        self._replicated = NamedSharding(self.mesh, REPLICATED)
        self._pool_sharding = NamedSharding(self.mesh, POOL_SPEC)
        if kv_cache.is_quantized(cfg.kv_cache_dtype):  # a QuantPool: values and scales, split by KV head
            self._pool_sharding = kv_cache.QuantPool(self._pool_sharding, NamedSharding(self.mesh, SCALE_SPEC))
        vocab = [NamedSharding(self.mesh, P(None, MODEL_AXIS))] if vocab_sharded(model_cfg, self.tp) else []
        self._logits_shardings = tuple(vocab) + (self._replicated,)
        L, Hkv, hd = model_cfg.num_layers, self.step_cfg.num_kv_heads, model_cfg.head_dim
        pool_shape = (L * num_blocks, cfg.block_size, Hkv, hd)  # [L*N, bs, Hkv, hd], Hkv split over devices
        zeros = jax.jit(lambda: kv_cache.zeros_pool(pool_shape, cfg.kv_cache_dtype, self.dtype),
                        out_shardings=self._pool_sharding)
        if abstract:
            shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                  jax.eval_shape(zeros), self._pool_sharding)
            self.k_pool = self.v_pool = shapes
        else:
            self.k_pool, self.v_pool = zeros(), zeros()
        self.buckets = token_buckets(cfg.max_num_batched_tokens)
        self.num_logprobs = min(cfg.max_logprobs, model_cfg.vocab_size)
        self._compiled: dict[tuple[int, bool, bool], object] = {}  # (T, decode_only, verify) -> executable
        self.compiler_options = step_compiler_options(self.dtype, cfg.kv_cache_dtype, self.platform)
        self.compile_seconds = 0.0
        S = cfg.max_num_seqs
        self.batch = PersistentBatch(S, self.max_blocks_per_seq, max_model_len, cfg.block_size)
        # stay on the device while no slot uses penalties / no token is fed from the previous step
        self._no_history = self._put(self.batch.history)
        self._no_prev = self._put(np.zeros(S, np.int32))
        self.structured = structured or StructuredOutputs(None, model_cfg.vocab_size, S)  # grammar masks
        self.structured.all_ones = self._put(self.structured.all_ones)  # stays on device
        capture, steer = tuple(cfg.hidden_state_layers or ()), tuple(cfg.steering_layers or ())
        if capture or steer:  # research hooks compiled in (validated by the engine)
            self.batch.hooks = SlotHooks(S, capture, steer, model_cfg.hidden_size, self.dtype)
        self.controls = LogitControls(S)  # logit_bias, bad_words
        self.controls.none = {k: self._put(v) for k, v in self.controls.none.items()}
        self._prompt_logprobs_requests: weakref.WeakSet = weakref.WeakSet()
        self._routes_requests: weakref.WeakSet = weakref.WeakSet()  # return_routed_experts
        spec = cfg.speculative_config
        self.num_spec = spec.num_speculative_tokens if spec is not None else 0  # K proposals verified per slot
        self._no_draft_probs = (self._put(np.zeros((S, self.num_spec, model_cfg.vocab_size), np.float32))
                                if spec is not None and spec.method == "draft_model" else None)  # q [S, K, V]
        if self.num_spec:  # masks, bans and history at each proposed position (spec_decode/controls.py)
            self.positions = PositionControls(S, self.num_spec, self.structured.words)
            self.positions.none = {k: self._put(v) for k, v in self.positions.none.items()}

    @property
    def step_params(self) -> dict:
        """What the step takes as parameters: the model's, and the LoRA slot arrays when LoRA is on."""
        return self.params if self.lora is None else {**self.params, "lora": self.lora.arrays}

    def _put(self, arr: np.ndarray):
        """A host array replicated on the mesh (its shape and sharding only, when abstract)."""
        if self.abstract:
            return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=self._replicated)
        return place(arr, self.mesh, REPLICATED)

    # -- compilation ----------------------------------------------------------------------
    def variants(self) -> list[tuple[int, bool, bool]]:
        """The step's compiled variants, (T, decode_only, verify): one per token bucket; with a decode kernel,
        one per bucket a decode-only step fits; with speculative decoding, the verifying step per bucket,
        run when some scheduled request proposes (a step without proposals runs the plain one)."""
        v = [(t, False, False) for t in self.buckets]
        if self.backend in DECODE_KERNELS:  # decode-only steps use the backend's decode kernel
            v += [(t, True, False) for t in self.buckets if t <= max(self.cfg.max_num_seqs, self.buckets[0])]
        if self.num_spec:
            v += [(t, False, True) for t in self.buckets]
        return v

    @property
    def num_compilations(self) -> int:
        return len(self._compiled)

    def compiled_step(self, key: tuple):
        """The compiled step of variant `key` = (T, decode_only[, verify: default False]), compiling it if
        needed."""
        key = (*key, False)[:3]
        return self._compiled.get(key) or self._compile(*key)

    def _compile(self, T: int, decode_only: bool, verify: bool = False):
        host = self._dummy(T, verify)
        fn = functools.partial(_step, layout=layout(*host), cfg=self.step_cfg, num_logprobs=self.num_logprobs,
                               attn_fn=self._attention(decode_only),
                               logits_shardings=self._logits_shardings, logprobs_mode=self.cfg.logprobs_mode,
                               num_spec=self.num_spec if verify else 0, routes=bool(self.model_cfg.num_experts),
                               **({} if self.batch.hooks is None else dict(capture=self.batch.hooks.capture,
                                                                          steer=self.batch.hooks.steer)))
        if self.abstract:  # shapes only; Pallas lowers for the mesh's devices under jax.set_mesh
            packed, extra = jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else
                                         self._put(np.asarray(a)), (pack(*host), _separate(*host)))
            target = jax.set_mesh(self.mesh)
        else:
            packed, extra = self._device_inputs(*host)
            target = contextlib.nullcontext()
        rep, pool = self._replicated, self._pool_sharding
        params = jax.tree.map(lambda a: a.sharding, self.step_params)
        t0 = time.perf_counter()
        with target:
            compiled = jax.jit(fn, donate_argnums=(1, 2), in_shardings=(params, pool, pool, rep, rep),
                               out_shardings=(rep, pool, pool)).lower(
                self.step_params, self.k_pool, self.v_pool, packed, extra).compile(self.compiler_options)
        self.compile_seconds += time.perf_counter() - t0
        self._compiled[(T, decode_only, verify)] = compiled
        return compiled

    def _attention(self, decode_only: bool):
        """The step's attention: the backend's, or with batch_invariant the row-alone one on any backend."""
        if self.cfg.batch_invariant:
            return shard_heads(invariant_attention, self.mesh)
        return make_attention(self.backend, decode_only, self.mesh)

    def warmup(self, show_progress: bool = True) -> None:
        """Compile every step variant now (persistently cached on disk across starts)."""
        todo = [v for v in self.variants() if v not in self._compiled]
        from tqdm.auto import tqdm
        for key in tqdm(todo, desc="compiling step buckets", disable=not show_progress, unit="bucket"):
            self._compile(*key)

    def _dummy(self, T: int, verify: bool = False):
        empty = PersistentBatch(self.cfg.max_num_seqs, self.max_blocks_per_seq, 1, self.block_size)
        batch, sp = empty.prepare([], T)
        if self.lora is not None:
            batch["lora_index"] = np.zeros(T, np.int32)  # [T] each token's adapter slot
        batch["prev_tokens"], sp["history"] = self._no_prev, self._no_history
        sp.update(self.structured.bitmask_arrays([], self.cfg.max_num_seqs))  # all ones, any_mask False
        self._hook_inputs(sp, [])
        self._research_inputs([], T, batch, sp)
        if verify:
            batch.update(draft_inputs([], self.cfg.max_num_seqs, self.num_spec, self._no_draft_probs))
            sp.update(self.positions.none)
        return batch, sp

    def _hook_inputs(self, sp: dict, slots) -> None:
        """The research hooks' step inputs: steering [S, nS, D] (on the device), any_prompt_hidden."""
        hooks = self.batch.hooks
        if hooks is not None:
            if hooks.steer:
                sp["steering"] = hooks.device_steering(self._put)
            if hooks.capture:
                sp["any_prompt_hidden"] = np.bool_(hooks.wants_prompt[slots].any())

    def track(self, req) -> None:
        """Note a request that asks for prompt logprobs or routed experts or uses logit controls: steps that
        schedule none of them skip the per-request work of each."""
        if req.prompt_logprobs is not None:
            self._prompt_logprobs_requests.add(req)
        if req.params.return_routed_experts:
            self._routes_requests.add(req)
        if req.params.logit_bias or req.bad_words_token_ids:
            self.controls.requests.add(req)

    def _research_inputs(self, scheduled, T: int, batch: dict, sp: dict) -> list:
        """Add the inputs of prompt logprobs and logit controls; return prompt_logprobs.targets' rows."""
        batch["prompt_next"], rows = targets(scheduled, T, self._prompt_logprobs_requests)  # [T]
        sp["any_prompt_logprobs"] = np.bool_(bool(rows))
        sp.update(self.controls.arrays(scheduled))  # bias_ids [S, NB], bias_values [S, NB], any_bias
        return rows

    # -- one step -------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens ({self.buckets[-1]})")

    def execute(self, out: SchedulerOutput) -> dict[int, tuple[int, dict | None]]:
        """Run one step; return slot -> (sampled token, {token id: logprob} or None)."""
        return self.read(self.launch(out))

    def launch(self, out: SchedulerOutput, prev: Launched | None = None, pending=frozenset()) -> Launched:
        """Prepare and start one step, without waiting for it (JAX dispatches asynchronously).

        prev, pending (async scheduling): the previous step, not read back yet, and the requests whose
        last token is that step's sampled token: the device feeds it to this step."""
        S = self.cfg.max_num_seqs
        T = self.bucket_for(out.num_tokens)
        batch, sp = self.batch.prepare(out.scheduled, T, pending)
        if self.lora is not None:
            batch["lora_index"] = self.lora.token_index(out.scheduled, T)  # [T]
        batch["prev_tokens"] = prev.tokens if pending else self._no_prev
        sp["history"] = self.batch.history if sp["any_penalty"] else self._no_history
        sp.update(self.structured.bitmask_arrays(out.scheduled, S))  # bitmask [S, W], any_mask
        slots = [req.slot for req, _ in out.scheduled]
        self._hook_inputs(sp, slots)
        rows = self._research_inputs(out.scheduled, T, batch, sp)
        verify = self.num_spec > 0 and any(req.spec_token_ids for req, _ in out.scheduled)
        if verify:  # some request proposes: the verifying variant (else the plain step, at a plain step's cost)
            q = out.draft_probs if out.draft_probs is not None else self._no_draft_probs
            batch.update(draft_inputs(out.scheduled, S, self.num_spec, q))
            sp.update(self.positions.arrays(out.scheduled, self.structured, self.controls.requests, self.batch))
        key = (T, self.backend in DECODE_KERNELS and out.decode_only and T <= max(S, self.buckets[0]), verify)
        inputs = self._device_inputs(batch, sp)
        ((tokens, tok_lp, top_lp, top_ids, *hidden), prompt, *routes), self.k_pool, self.v_pool = \
            self.compiled_step(key)(self.step_params, self.k_pool, self.v_pool, *inputs)
        plan = self.batch.hooks.plan(out.scheduled, slots) if hidden else ()
        return Launched(out, slots, tokens, (tok_lp, top_lp, top_ids), hidden=tuple(hidden), hidden_plan=plan,
                        prompt=prompt, prompt_rows=rows, any_logprobs=bool(sp["any_logprobs"]),
                        routes=routes[0] if routes else None,
                        routes_rows=routed_experts.plan(out.scheduled, self._routes_requests) if routes else [],
                        verified=verify)

    def read(self, step: Launched) -> dict[int, tuple[int, dict | None]]:
        """Wait for a launched step; return slot -> (sampled token, {token id: logprob} or None) (with
        speculative decoding: slot -> (new tokens, their logprob dicts or None), spec_decode/step.py)."""
        routed_experts.collect(step.routes_rows, step.routes)  # read back only when some request asked
        collect(step.prompt_rows, step.prompt)
        if step.verified:
            return read_verified(step)
        result = self._read_sampled(step)
        if self.num_spec:  # a step without proposals, in the verified steps' form
            return {s: ([tok], None if lp is None else [lp]) for s, (tok, lp) in result.items()}
        return result

    def _read_sampled(self, step: Launched) -> dict[int, tuple[int, dict | None]]:
        tokens = np.asarray(step.tokens).tolist()
        if step.hidden_plan:
            read_hidden(step.hidden_plan, step.hidden)
        result = {s: (tokens[s], None) for s in step.slots}
        if not step.any_logprobs:
            return result
        want_lp = [(r, s) for (r, _), s in zip(step.out.scheduled, step.slots) if r.params.logprobs is not None]
        tok_lp, top_lp, top_ids = (np.asarray(a) for a in step.logprobs)
        for req, s in want_lp:
            k = req.params.logprobs
            lp = {int(i): float(v) for i, v in zip(top_ids[s, :k], top_lp[s, :k])}
            lp[tokens[s]] = float(tok_lp[s])
            result[s] = (tokens[s], lp)
        return result

    def _device_inputs(self, batch: dict, sp: dict) -> tuple:
        """The step's host inputs -> what the compiled step takes: one packed int32 buffer (a single
        host->device copy) and the arrays that may already live on the device (prev_tokens, history).

        Within one process the host arrays go as they are: the compiled call copies them to every device
        of its (replicated) input sharding, ~4x cheaper than `jax.device_put` first. A mesh spanning
        processes needs global arrays, built from each process's identical copy."""
        packed, extra = pack(batch, sp), _separate(batch, sp)
        if self.mesh.is_multi_process:
            return jax.tree.map(lambda a: a if isinstance(a, jax.Array) else place(np.asarray(a), self.mesh,
                                                                                  REPLICATED), (packed, extra))
        return packed, extra

    # -- device state: the engine's controls change it only through these ---------------------
    def replace_params(self, params) -> None:
        """Swap in a parameter pytree of the same structure, shapes and shardings (no recompilation)."""
        self.params = params

    def device_arrays(self) -> list:
        """The device arrays the runner holds: parameters and KV pools (abstract leaves left out)."""
        return [a for a in jax.tree.leaves((self.params, self.k_pool, self.v_pool)) if isinstance(a, jax.Array)]

    @property
    def params_on_device(self) -> bool:
        return all(isinstance(a, jax.Array) for a in jax.tree.leaves(self.params))

    def reset_pools(self, only_lost: bool = False) -> bool:
        """Zero the KV pools (same shapes, dtypes and shardings). only_lost: only a pool that a failed
        donated call deleted or poisoned. Returns whether a pool was replaced (its contents are gone)."""
        replaced = False
        for name in ("k_pool", "v_pool"):
            old = getattr(self, name)  # an array, or a QuantPool (values and scales: replaced together)
            if not only_lost or any([_lost(a) for a in jax.tree.leaves(old)]):
                setattr(self, name, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), old))
                replaced = True
        return replaced

    def offload(self, keep_params: bool) -> dict | None:
        """Free the device: the pools' and parameters' arrays are deleted, `jax.ShapeDtypeStruct`s with their
        shardings stand in their place (shapes stay checkable). Returns the parameters copied to host memory
        first when keep_params, else None."""
        host = jax.device_get(self.params) if keep_params else None
        for name in ("k_pool", "v_pool", "params"):
            old = getattr(self, name)
            setattr(self, name, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                             old))
            for a in jax.tree.leaves(old):
                if isinstance(a, jax.Array):
                    a.delete()
        return host

    def restore(self, host_params=None) -> None:
        """Undo `offload`: parameters still abstract are put back from `host_params` with their shardings
        (leaves already on the device, e.g. from a weight update, are kept); the pools come back zeroed."""
        if host_params is not None:
            self.params = jax.tree.map(lambda cur, a: cur if isinstance(cur, jax.Array)
                                       else jax.device_put(np.asarray(a), cur.sharding), self.params, host_params)
        self.reset_pools()

    def memory_per_device(self) -> dict:
        """Bytes of parameters and of the KV pools held by this process's first device of the mesh (read
        from the arrays' shards)."""
        dev = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

        def on_first(arrays):
            return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == dev)
        return dict(param_bytes_per_device=on_first(jax.tree.leaves(self.params)),
                    kv_bytes_per_device=on_first(jax.tree.leaves((self.k_pool, self.v_pool))))
