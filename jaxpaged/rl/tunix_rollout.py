"""Tunix rollout engine: `JaxpagedRollout`, a `tunix.rl.rollout.base_rollout.BaseRollout` that rolls out
through jaxpaged (continuous batching, paged KV) instead of Tunix's vanilla sampler.

    cluster_config = ClusterConfig(..., rollout_engine=functools.partial(JaxpagedRollout, max_num_seqs=64))

Keyword arguments of the partial are EngineConfig fields, and `lora_alpha` for a qwix LoRA actor. The engine
starts from the rollout actor itself: Tunix's Llama 3 (`tunix.models.llama3`), Qwen3 (`tunix.models.qwen3`,
dense), Qwen2 (`tunix.models.qwen2`) and Gemma 3 (`tunix.models.gemma3`, text) models map onto the engine's
parameter pytree (jaxpaged/models/llama.py: layers stacked, Tunix's einsum weights flattened to [in, out]);
per family, the config.json and where each parameter sits are in jaxpaged/rl/tunix_models.py; any other model
is a ValueError naming it. The weights move device to device, only a config.json goes through a temporary
directory. Tunix is imported only in jaxpaged/rl/ (the `tunix` extra).

LoRA (qwix `LoraProvider` on the projections, `nnx.LoRAParam`): merged into the engine's base weights,
W + alpha / r * A.B in float32, not put in the engine's adapter slots. Why: the merged step is the plain
step (no LoRA product compiled in, nothing per token); Tunix syncs under a CPU transfer guard that forbids
host round trips, and the merge runs on the device while the slots are filled from host arrays; in float32
the merged engine's greedy tokens are the qwix model's (tests/test_tunix_rollout.py). The cost: in bfloat16
a LoRA delta under half a unit in the last place of W rounds away in the merged weight, where the qwix model
adds it to the product. alpha is not in the model (qwix keeps it in its provider): pass the provider's.

Sampling reads `RolloutConfig` as Tunix's vanilla sampler (tunix/generate/sampler.py) does: greedy unless
`top_p` is set (RolloutConfig's default is 1.0); with it, `temperature`, then `top_k` (None or 0: the whole
vocabulary), then `top_p` over the top-k; so `RolloutConfig(temperature=1.0, top_p=None)` decodes greedily.
"""
from __future__ import annotations

import functools
import json
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import tokenizer_adapter
from tunix.rl.rollout import base_rollout

from jaxpaged.config import EngineConfig
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.llm import LLM
from jaxpaged.rl.tunix_models import family_of_config, family_of_model, hf_config


def _value(v):
    return v.value if hasattr(v, "value") else v


LORA_A, LORA_B = "_lora_a", "_lora_b"  # qwix's LoRA parameters beside the weight they adapt: w_lora_a, w_lora_b


def _get(tree, path):
    for k in path:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return _value(tree)


def _lora_keys(tree, prefix=()) -> set:
    """Paths of every qwix LoRA A in a pure-dict state."""
    if not isinstance(tree, dict):
        return set()
    out = set()
    for k, v in tree.items():
        if isinstance(k, str) and k.endswith(LORA_A):
            out.add(prefix + (k,))
        out |= _lora_keys(v, prefix + (k,))
    return out


@functools.partial(jax.jit, static_argnums=3)
def _merge(w, a, b, scale: float):
    """W + scale * A.B in float32. Jitted, the scale a constant of the program: Tunix syncs under a transfer
    guard on CPU that refuses even a Python scalar sent to the device."""
    f32 = jnp.float32
    return w.astype(f32) + jnp.tensordot(a.astype(f32), b.astype(f32), axes=1) * scale


class _Reader:
    """Weights of a pure-dict Tunix state at a path, with qwix LoRA merged in: W + alpha / r * A.B (A [in..., r],
    B [r, out...], contracted over r, in float32, then the engine's dtype). W comes from the state or, when the
    state holds only the LoRA parameters (Tunix's LoRA sync), from `base`."""

    def __init__(self, st: dict, base: dict | None, lora_alpha: float | None):
        self.st, self.base, self.alpha = st, base, lora_alpha
        self.lora = _lora_keys(st)
        self.used: set = set()
        if self.lora and lora_alpha is None:
            raise ValueError("JaxpagedRollout: the model has LoRA parameters (nnx.LoRAParam, qwix): pass lora_alpha= "
                             "(the alpha of the qwix LoraProvider) so the engine merges W + alpha / rank * A.B")

    def __call__(self, path):
        a_path = path[:-1] + (path[-1] + LORA_A,)
        if a_path not in self.lora:
            return _get(self.st, path)
        w = _get(self.st, path)
        if w is None and self.base is not None:
            w = _get(self.base, path)
        a, b = _get(self.st, a_path), _get(self.st, path[:-1] + (path[-1] + LORA_B,))
        if w is None or b is None:
            raise ValueError(f"JaxpagedRollout: LoRA at {'.'.join(map(str, path))} lacks its "
                             f"{'base weight' if w is None else 'B'}")
        if a.shape[:-1] + b.shape[1:] != w.shape:
            raise ValueError(f"JaxpagedRollout: LoRA at {'.'.join(map(str, path))}: A {a.shape} . B {b.shape} is "
                             f"not the weight's shape {w.shape}")
        self.used.add(a_path)
        return _merge(w, a, b, self.alpha / a.shape[-1])

    def from_base(self, path):
        return None if self.base is None else _get(self.base, path)


def to_engine_params(state, cfg, tied: bool, dtype, lora_alpha: float | None = None, base=None) -> dict:
    """Tunix model state (nnx.State of nnx.Param, or a part of it) -> the engine's parameter pytree (the part
    the state holds). qwix LoRA pairs in the state are merged into their weight (`_Reader`); with a LoRA-only
    state, `base` (the model's other parameters) gives the weights, and only the adapted leaves come out.
    Arrays stay on their devices; reshapes and the layer stack run there."""
    fam = family_of_config(cfg)
    pure = lambda s: s.to_pure_dict() if hasattr(s, "to_pure_dict") else s
    read = _Reader(pure(state), None if base is None else pure(base), lora_alpha)
    # copies: the engine may donate its parameter buffers, which stay the trainer's
    cast = lambda a: jnp.array(a, dtype, copy=True)
    out: dict = {}
    for leaf, path in fam.top.items():
        w = read(path)
        if w is not None and not (leaf == "lm_head" and tied):
            out[leaf] = cast(w)
    layers = read.st.get("layers")
    if layers:
        base_layers = (read.base or {}).get("layers") or {}
        keys = [i if i in layers or i in base_layers else str(i) for i in range(cfg.num_layers)]  # int or str keys
        stacked = {}
        for leaf, choices in fam.layer.items():
            for path, how in choices:  # the first layout the state (or the base) holds
                per = [read(("layers", k) + path) for k in keys]
                if any(w is not None for w in per) or any(read.from_base(("layers", k) + path) is not None
                                                          for k in keys):
                    break
            if all(w is None for w in per):
                continue
            if any(w is None for w in per):  # LoRA on some layers only: the others' weights from the base
                per = [read.from_base(("layers", k) + path) if w is None else w for k, w in zip(keys, per)]
                if any(w is None for w in per):
                    raise ValueError(f"JaxpagedRollout: {leaf} ({'.'.join(path)}) is given for some layers only")
            stacked[leaf] = jnp.stack([cast(how(w)) for w in per])  # [L, ...]
        if stacked:
            out["layers"] = stacked
    unused = read.lora - read.used
    if unused:
        raise ValueError("JaxpagedRollout: LoRA on modules the engine does not adapt: "
                         + ", ".join(".".join(map(str, p)) for p in sorted(unused, key=str)))
    return out


class JaxpagedRollout(base_rollout.BaseRollout):
    """Tunix's rollout through a jaxpaged engine built from `rollout_actor` (see the module docstring)."""

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh: jax.sharding.Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None, lora_alpha: float | None = None,
                 **engine_kwargs):
        self._model = rollout_actor
        self._lora_alpha = lora_alpha
        self._tokenizer = tokenizer_adapter.TokenizerAdapter(tokenizer)
        cfg = rollout_config or base_rollout.RolloutConfig()
        self._tied = family_of_model(rollout_actor).tied(rollout_actor.config)
        self.mesh = mesh
        # as long as the vanilla sampler's KV cache (prompts longer than max_prompt_length are not cut)
        engine_kwargs.setdefault("max_model_len", max(cfg.kv_cache_size,
                                                      cfg.max_prompt_length + cfg.max_tokens_to_generate))
        engine_kwargs.setdefault("dtype", "float32" if cfg.data_type is None else jnp.dtype(cfg.data_type).name)
        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        engine_kwargs.setdefault("show_progress", False)
        self._dtype = jnp.dtype(engine_kwargs["dtype"])
        with tempfile.TemporaryDirectory() as d:  # config.json only: the weights come as a pytree
            conf = hf_config(rollout_actor, self.eos_id(), engine_kwargs["max_model_len"])
            with open(f"{d}/config.json", "w") as f:
                json.dump(conf, f)
            params = to_engine_params(nnx.state(rollout_actor, nnx.Param), rollout_actor.config, self._tied,
                                      self._dtype, lora_alpha)
            devices = list(mesh.devices.flat) if mesh is not None else None
            self.engine = LLMEngine(EngineConfig(model=d, **engine_kwargs), devices, params=params)
        self._llm = LLM.from_engine(self.engine)

    # -- tokens ----------------------------------------------------------------------------
    def _tokenize(self, prompt: str) -> list[int]:
        """As Tunix's sampler: BOS (when the tokenizer has one) + the encoding, a doubled BOS removed."""
        tok = self._tokenizer
        bos = [tok.bos_id()] if tok.bos_id() else []
        return list(np.asarray(tok.dedup_bos_ids(bos + list(tok.encode(prompt))), np.int32))

    def _sampling(self, rc: base_rollout.RolloutConfig, i: int) -> SamplingParams:
        seed = None if rc.seed is None else int(np.asarray(jax.random.key_data(rc.seed)
                                                           if jnp.issubdtype(jnp.asarray(rc.seed).dtype,
                                                                             jax.dtypes.prng_key)
                                                           else rc.seed).ravel()[-1]) + i
        # as Tunix's vanilla sampler reads the config: it samples only when top_p is set (top_k alone does not
        # sample), at the temperature, top-k then top-p; otherwise it decodes greedily at any temperature
        greedy = rc.top_p is None or not rc.temperature
        return SamplingParams(max_tokens=rc.max_tokens_to_generate, temperature=0.0 if greedy else rc.temperature,
                              top_p=1.0 if rc.top_p is None else rc.top_p,
                              top_k=0 if rc.top_k is None else rc.top_k, seed=seed,
                              stop_token_ids=list(rc.eos_tokens) if rc.eos_tokens else None,
                              ignore_eos=bool(rc.eos_tokens), logprobs=0 if rc.return_logprobs else None)

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        """Every prompt submitted at once; outputs in prompt order. Generated tokens end before the first EOS
        (as Tunix's sampler returns them); prompts are left-padded with pad_id() to max_prompt_length (or
        the next power of two above the longest prompt)."""
        rc = rollout_config
        tokens = [self._tokenize(p) for p in prompts]
        outs = self._llm.generate([{"prompt_token_ids": t} for t in tokens],
                                  [self._sampling(rc, i) for i in range(len(tokens))], use_tqdm=False)
        eos = set(rc.eos_tokens or [self.eos_id()])
        gen, logps = [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            n = next((j for j, t in enumerate(ids) if t in eos), len(ids))
            gen.append(np.asarray(ids[:n], np.int32))
            if rc.return_logprobs:
                logps.append([c.logprobs[j][t] for j, t in enumerate(ids[:n])])
        longest = max(len(t) for t in tokens)
        width = rc.max_prompt_length
        if width < longest:
            width = 1 << (longest - 1).bit_length()
        padded = np.full((len(tokens), width), self.pad_id(), np.int32)  # [B, width]
        for i, t in enumerate(tokens):
            padded[i, width - len(t):] = t
        return base_rollout.RolloutOutput(text=[self._tokenizer.decode(g.tolist()) for g in gen], logits=[],
                                          tokens=gen, left_padded_prompt_tokens=padded,
                                          logprobs=logps if rc.return_logprobs else None)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """f32[B, C]: log p of each completion token (left-padded prompts [B, P], right-padded completions
        [B, C]) by the engine's dense scoring; positions at and after the first EOS (or a pad) are 0."""
        prompts, comps = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        pad, eos = self.pad_id(), self.eos_id()
        out = np.zeros(comps.shape, np.float32)  # [B, C]
        p_list, c_list, lens = [], [], []
        for p, c in zip(prompts, comps):
            p_list.append([int(t) for t in p[np.argmax(p != pad):]] if (p != pad).any() else [])
            stop = np.nonzero((c == eos) | (c == pad))[0]
            n = int(stop[0]) + int(stop[0] < len(c) and c[stop[0]] == eos) if len(stop) else len(c)
            c_list.append([int(t) for t in c[:n]])
            lens.append(n)
        rows = [i for i, n in enumerate(lens) if n]  # an empty completion has nothing to score
        if rows:
            scores = self._llm.score([p_list[i] for i in rows], [c_list[i] for i in rows])
            for i, s in zip(rows, scores):
                out[i, :lens[i]] = s
        return jnp.asarray(out)

    def update_params(self, params, filter_types=None) -> None:
        """Parameters (nnx.Param state, all or part of the model) mapped to the engine's pytree and loaded with
        `update_weights` (no recompilation; prefix cache flushed; resharded onto the engine's devices when
        they live elsewhere). A LoRA state (Tunix syncs only the nnx.LoRAParam when the actor has LoRA) is
        merged into the base weights, W + lora_alpha / r * A.B with W the rollout actor's own frozen base
        weights, and only the adapted weights are replaced (docs/research.md: why merged, not adapter slots)."""
        has_lora = bool(_lora_keys(params.to_pure_dict() if hasattr(params, "to_pure_dict") else params))
        base = nnx.state(self._model, nnx.Not(nnx.LoRAParam)) if has_lora else None
        new = to_engine_params(params, self._model.config, self._tied, self._dtype, self._lora_alpha, base)
        self.engine.controls.update_weights(new)

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self) -> None:
        """None, as Tunix's vLLM rollout answers: the engine holds its own copy of the weights. Tunix's learner
        syncs weights after each global step only when the rollout's model does not share the trainer's arrays
        (`rl_utils.is_sharing_weights`); answering the trainer's own actor would turn the sync off and leave
        the engine on the first weights."""
        return None
