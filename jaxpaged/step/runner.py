"""The jit boundary: params and the KV pool on device, scheduler output -> padded arrays -> one step.

Every step has the same shapes except the token count T, padded up to a bucket (powers of two up to
`max_num_batched_tokens`); each bucket (and, with the Pallas backend, a decode-only variant of the
small ones) is compiled ahead of time at start-up, so a running engine never compiles.

The runner owns a mesh (see `jaxpaged/step/mesh.py`): params sharded by their partition specs, the pools
by KV head, step inputs and outputs replicated; each compiled step donates the pools (updated in place).
Its host inputs come from the persistent batch (`jaxpaged/core/batch.py`) and go to the device as one packed
buffer; `launch` starts a step without waiting, `read` waits for its tokens (async scheduling runs the
next `launch` in between). The step's features (research hooks, prompt logprobs, routed experts, logit
controls, grammar masks, LoRA, prompt embeddings) each add their inputs and read back their outputs through
one interface (`jaxpaged/step/features.py`); the step itself is one pure function (`jaxpaged/step/traced.py`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.config import EngineConfig, ModelConfig
from jaxpaged.core.batch import NUM_BANNED, SEPARATE, PersistentBatch, layout, pack  # noqa: F401 (re-export)
from jaxpaged.core.logit_controls import LogitControls
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.step_result import StepResult
from jaxpaged.core.structured import StructuredOutputs
from jaxpaged.lora.slots import LoRASlots
from jaxpaged.models.packed import pack_layers
from jaxpaged.models.qpacked import pack_quantized
from jaxpaged.spec_decode.step import Verification
from jaxpaged.step import host_malloc, huge_pages, kv_cache
from jaxpaged.step.attention import DECODE_KERNELS, make_attention, resolve_backend, shard_heads, target_platform
from jaxpaged.step.batch_invariant import ROW_TILE, invariant_attention
from jaxpaged.step.features import GrammarMask, LogitBias, LoRAIndex, Sampling, StepFeature, add_logprobs
from jaxpaged.step.matmul import matmul_name, resolve_matmul, resolve_quant_matmul, weights_quantization
from jaxpaged.step.mesh import (
    MODEL_AXIS,
    POOL_SPEC,
    REPLICATED,
    SCALE_SPEC,
    make_mesh,
    place,
    place_params,
    sharded_model_config,
    vocab_sharded,
)
from jaxpaged.step.pooling import Pooler
from jaxpaged.step.prompt_embeds import PromptEmbeds
from jaxpaged.step.prompt_logprobs import PromptLogprobs
from jaxpaged.step.research import SlotHooks
from jaxpaged.step.routed_experts import RoutedExperts
from jaxpaged.step.sampler import jnp_argmax
from jaxpaged.step.sink import NoSink, StepSink
from jaxpaged.step.token_logprobs import TokenLogprobs
from jaxpaged.step.traced import Variant, traced_step
from pallas_kernels.argmax import cpu as cpu_argmax


def token_buckets(max_tokens: int, smallest: int = 8, lone: bool = False) -> list[int]:
    """The step's token counts T: smallest, doubling, below max_tokens, then max_tokens; with `lone`
    (`has_lone_bucket`), a 1-token bucket first."""
    out, b = [1] if lone and 1 < min(smallest, max_tokens) else [], smallest
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


def has_lone_bucket(platform: str, backend: str, speculative: bool, kernel_products: bool) -> bool:
    """Whether the step has a 1-token bucket, for a lone decoding request. On a CPU every op but the
    products (norms, RoPE, the KV writes, attention, the head's logits, the sampler) runs over every row of
    the bucket, padding included: in bucket 8 a lone request's step of a 1B-class int8 model spent ~2 ms of
    its ~60 ms of CPU time on 7 padding rows, for one compilation more. Only where the weight products are
    the CPU kernels (`kernel_products`: bfloat16 or quantized weights), which compute a live row alike in
    any bucket (the 1B int8 model's tokens and logprobs at T = 1 equal bucket 8's bit for bit); XLA's
    float32 dot rounds a 1-row product unlike an 8-row one. Not with speculative decoding (its proposals
    fill bucket 8's padding), nor on accelerators (padding rows run in parallel there), nor with an
    accelerator's attention kernel interpreted on a CPU (`backend` in DECODE_KERNELS: tests)."""
    return platform == "cpu" and backend not in DECODE_KERNELS and not speculative and kernel_products


@dataclass
class Launched:
    """A step started on the device: its schedule and its outputs (device arrays, maybe not ready)."""
    out: SchedulerOutput
    slots: list[int]       # of out.scheduled, at launch (a request may leave its slot before the read)
    key: tuple             # the variant run, (T, decode_only, verify)
    tokens: jax.Array      # i32[S]; verifying: i32[S, K+1], -1 past each slot's new tokens
    logprobs: tuple        # token f32[S(, K+1)], top f32[S(, K+1), NL], top ids i32[S(, K+1), NL]
    any_logprobs: bool     # some scheduled request asked for logprobs (else none are read back)
    reads: tuple = ()      # (feature, its plan, its outputs) for each feature with something to read back
    pending: frozenset = frozenset()  # requests whose token of this step is not on the host yet


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
    the variants only compile (for any target, compile-only topology devices included). `step_sink`
    (jaxpaged/step/sink.py) receives each step's host inputs and runs each whole step."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, params: dict, num_blocks: int,
                 max_model_len: int, mesh=None, structured: StructuredOutputs | None = None,
                 abstract: bool = False, step_sink: StepSink | None = None):
        self.step_sink = step_sink if step_sink is not None else NoSink()  # where each step's inputs go too
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
        n_dev = self.mesh.devices.size
        quantized = weights_quantization(params, cfg.quantization)  # a GGUF kept quantized: its codes' format
        if resolve_matmul(cfg.matmul_backend, self.dtype, self.platform, n_dev, quantized):
            self.step_cfg = dataclasses.replace(self.step_cfg, cpu_matmul=True)  # jaxpaged/step/matmul.py
        self.quant_matmul = resolve_quant_matmul(cfg.matmul_backend, quantized, self.platform, n_dev)
        self.matmul_backend = matmul_name(self.step_cfg.cpu_matmul, self.quant_matmul)
        self.num_blocks, self.block_size = num_blocks, cfg.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // cfg.block_size)
        self.backend = resolve_backend(cfg.attention_backend, model_cfg.head_dim, cfg.block_size,
                                       self.mesh.devices.flat, dtype=self.dtype, kv_cache_dtype=cfg.kv_cache_dtype)
        self.kv_pool_dtype = jnp.dtype(kv_cache.storage_dtype(cfg.kv_cache_dtype, self.dtype)).name  # stats()
        if cfg.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        self.params = params if abstract else place_params(params, model_cfg, self.mesh)
        self.params = self._packed(self.params, owned=not abstract)  # placed just now: the runner's own
        if self.step_cfg.cpu_matmul or self.quant_matmul:  # the CPU kernels read them faster from huge pages
            huge_pages.collapse(a for a in jax.tree.leaves(self.params) if isinstance(a, jax.Array))
        if self.platform == "cpu" and not abstract:  # a step's buffers reused, not faulted in afresh (host_malloc.py)
            host_malloc.keep_freed_memory()
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
        self.buckets = token_buckets(cfg.max_num_batched_tokens, lone=has_lone_bucket(
            self.platform, self.backend, cfg.speculative_config is not None,
            self.step_cfg.cpu_matmul or self.quant_matmul))
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
        self.controls = LogitControls(S)  # logit_bias, bad_words
        spec = cfg.speculative_config
        self.num_spec = spec.num_speculative_tokens if spec is not None else 0  # K proposals verified per slot
        self.features = self._features()
        self._sampling = self._samplings()  # verify -> how the variant draws

    def _features(self) -> tuple[StepFeature, ...]:
        """The step's features, chosen once (step/features.py); research hooks before routes, as the
        decoder returns their outputs."""
        cfg, S = self.cfg, self.cfg.max_num_seqs
        features = [LoRAIndex(self.lora)] if self.lora is not None else []
        if cfg.enable_prompt_embeds:  # prompts given as embeddings (jaxpaged/step/prompt_embeds.py)
            features.append(PromptEmbeds(self.buckets[-1], self.model_cfg.hidden_size, self._put))
        features += [GrammarMask(self.structured, S, self._put), LogitBias(self.controls, self._put),
                     PromptLogprobs(self.num_logprobs), TokenLogprobs(S, cfg.logprobs_mode, self._put)]
        capture, steer = tuple(cfg.hidden_state_layers or ()), tuple(cfg.steering_layers or ())
        if capture or steer:  # research hooks compiled in (validated by the engine)
            self.batch.hooks = SlotHooks(S, capture, steer, self.model_cfg.hidden_size, self.dtype, self._put)
            features.append(self.batch.hooks)
        if self.model_cfg.num_experts:
            features.append(RoutedExperts())
        if cfg.pooling:  # --runner pooling: embeddings (jaxpaged/step/pooling.py)
            features.append(Pooler())
        return tuple(features)

    def _samplings(self) -> dict[bool, Sampling]:
        """How each variant draws, by its `verify`: the plain sampler; with speculative decoding, the
        verifier beside it, and the plain step's tokens read back in the verified steps' form."""
        lp, mode = self.num_logprobs, self.cfg.logprobs_mode
        if not self.num_spec:
            # one CPU device: the greedy rows' argmax by the CPU kernel (XLA's is not vectorized there) where
            # its build is measured faster (cpu_argmax.auto_skip says why not)
            one_cpu = self.platform == "cpu" and self.mesh.devices.size == 1 and cpu_argmax.auto_skip() is None
            return {False: Sampling(lp, mode, self.step_cfg.row_tile, cpu_argmax.cpu_argmax if one_cpu else jnp_argmax)}
        verify = Verification(lp, mode, self.num_spec, self.structured, self.controls, self.batch,
                              self.model_cfg.vocab_size, self.cfg.speculative_config.method == "draft_model",
                              self._put)
        return {False: Sampling(lp, mode), True: verify}

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
        """The step of variant `key` = (T, decode_only[, verify: default False]): the compiled one (compiled
        if needed), or what the wrapper given to `wrap_steps` makes of it."""
        key = (*key, False)[:3]
        compiled = lambda: self._compiled.get(key) or self._compile(*key)
        return compiled() if self._step_wrap is None else self._step_wrap(key, compiled)

    _step_wrap = None  # wrap_steps' wrapper; None: the compiled steps run as they are

    def wrap_steps(self, wrap=None) -> None:
        """The timing seam: from now on the step of variant `key` is `wrap(key, compiled)`, where `compiled()`
        returns the runner's own compiled step (compiling it at first use); `None` restores the compiled steps.
        A step is called as step(params, k_pool, v_pool, packed, extra) -> ((sampled, outputs), k_pool, v_pool).
        A wrapper that times or records calls `compiled()` and calls through it; a stand-in for the device
        (`jaxpaged bench host --null-device`) returns its own function and compiles nothing. The benchmarks
        set it (jaxpaged/bench/host.py, kv_cache.py, step_message.py); the engine never does."""
        if wrap is not None and not callable(wrap):
            raise TypeError(f"wrap_steps: wrap must be a callable (key, compiled) -> step or None, got {wrap!r}")
        self._step_wrap = wrap

    def _compile(self, T: int, decode_only: bool, verify: bool = False):
        host = self.dummy_inputs(T, verify)
        variant = Variant(layout(*host), self.step_cfg, self._attention(decode_only), self._logits_shardings,
                          self._sampling[verify], self.features)
        fn = functools.partial(traced_step, variant=variant)
        if self.abstract:  # shapes only; Pallas lowers for the mesh's devices under jax.set_mesh
            packed, extra = jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else
                                         self._put(np.asarray(a)), (pack(*host), _separate(*host)))
            target = jax.set_mesh(self.mesh)
        else:
            packed, extra = self.device_inputs(*host)
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

    def dummy_inputs(self, T: int, verify: bool = False) -> tuple[dict, dict]:
        """The host inputs of a step with nothing scheduled (what a variant is compiled with)."""
        empty = PersistentBatch(self.cfg.max_num_seqs, self.max_blocks_per_seq, 1, self.block_size)
        return self._step_inputs(SchedulerOutput(), T, verify, empty, self._no_prev)[:2]

    def _step_inputs(self, out: SchedulerOutput, T: int, verify: bool, persistent: PersistentBatch, prev_tokens,
                     pending=frozenset()) -> tuple[dict, dict, list, list]:
        """(batch, sp, slots, each feature's read-back plan) of one step: the persistent batch's arrays,
        the tokens fed from the previous step (prev_tokens i32[S], on the device), the penalties' history,
        then each feature's inputs and the variant's draw's."""
        batch, sp = persistent.prepare(out.scheduled, T, pending)
        batch["prev_tokens"] = prev_tokens
        sp["history"] = self.batch.history if sp["any_penalty"] else self._no_history
        slots = [req.slot for req, _ in out.scheduled]
        plans = [f.inputs(out, slots, T, batch, sp) for f in self.features]
        self._sampling[verify].inputs(out, slots, T, batch, sp)
        return batch, sp, slots, plans

    def track(self, req) -> None:
        """Note an admitted request: a feature (prompt logprobs, routed experts, logit controls) skips the
        per-request work of steps that schedule none of the requests using it."""
        for f in self.features:
            f.track(req)

    def placeholders(self, verify: bool = False) -> dict:
        """The device arrays that stand in for step inputs nobody uses this step (the previous step's
        tokens, the penalties' history, the features' unused masks and controls): a multi-host follower
        rebuilds from them what the step message leaves out."""
        out = dict(prev_tokens=self._no_prev, history=self._no_history)
        for f in (*self.features, self._sampling[verify]):
            out.update(f.placeholders)
        return out

    # -- one step -------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens ({self.buckets[-1]})")

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step; return what it computed (core/step_result.py: per scheduled slot its new tokens)."""
        return self.step_sink.guard(lambda: self.read(self.launch(out)))

    def launch(self, out: SchedulerOutput, prev: Launched | None = None, pending=frozenset()) -> Launched:
        """Prepare and start one step, without waiting for it (JAX dispatches asynchronously).

        prev, pending (async scheduling): the previous step, not read back yet, and the requests whose
        last token is that step's sampled token: the device feeds it to this step."""
        S, T = self.cfg.max_num_seqs, self.bucket_for(out.num_tokens)
        # some request proposes: the verifying variant (else the plain step, at a plain step's cost)
        verify = self.num_spec > 0 and any(req.spec_token_ids for req, _ in out.scheduled)
        key = (T, self.backend in DECODE_KERNELS and out.decode_only and T <= max(S, self.buckets[0]), verify)
        batch, sp, slots, plans = self._step_inputs(out, T, verify, self.batch,
                                                    prev.tokens if pending else self._no_prev, pending)
        inputs = self.device_inputs(batch, sp)
        self.step_sink.send(key, batch, sp)
        ((tokens, *logprobs), outputs), self.k_pool, self.v_pool = \
            self.compiled_step(key)(self.step_params, self.k_pool, self.v_pool, *inputs)
        reads = tuple((f, plan, o) for f, plan, o in zip(self.features, plans, outputs) if plan)
        return Launched(out, slots, key, tokens, tuple(logprobs), bool(sp["any_logprobs"]), reads)

    def read(self, step: Launched) -> StepResult:
        """Wait for a launched step; return what it computed: per scheduled slot its new tokens and their
        logprobs (a verifying step's: accepted proposals, then the next token; spec_decode/step.py), the
        features' logprob entries added. (Research hooks, prompt logprobs and routed experts store what
        they read on the requests they serve: step/features.py.)"""
        more = [feature.read(plan, outputs, step) for feature, plan, outputs in step.reads]
        sampled = self._sampling[step.key[2]].read_tokens(step)
        for entries in more:
            if entries:
                add_logprobs(sampled, entries)
        return StepResult(sampled)

    def device_inputs(self, batch: dict, sp: dict) -> tuple:
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
        """Swap in a parameter pytree of the same structure, shapes and shardings (no recompilation); plain
        layer matrices are packed as the runner keeps them (`_packed`) when its products need it."""
        self.params = self._packed(params, like=self.params)

    def _packed(self, params, owned: bool = False, like=None):
        """The layer matrices as the step's kernels read them, packed once: bfloat16 ones (and the head) in
        the bfloat16 kernel's tile order (packed.Packed), int8 / int4 ones in the quantized kernel's
        (qpacked.QPacked; like: the parameters they replace, whose packed layouts they keep)."""
        if self.step_cfg.cpu_matmul:
            params = pack_layers(params, owned=owned)
        return (pack_quantized(params, owned=owned, like=like, act_bits=self.cfg.quantization_activation_bits)
                if self.quant_matmul else params)

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
