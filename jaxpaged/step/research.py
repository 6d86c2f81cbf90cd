"""Research hooks of the step: hidden-state capture and steering (docs/research.md).

Layer indices count as transformers' `output_hidden_states` does: 0 = the embeddings, i = the output of
decoder layer i-1 (the residual stream entering layer i), num_layers = the last layer's output after the
final norm. `EngineConfig.hidden_state_layers` and `steering_layers` fix, at compile time, where the step
captures and where it adds; requests choose per slot, with no recompilation:

- steering: each slot's vectors live on the device ([S, nS, D], a step input beside the packed buffer)
  and are copied there again only after a request with (or a slot that had) steering joins a slot;
- hidden states: the step returns the captured states at the rows whose logits gave each slot's tokens
  ([S, N, nL, D], always; N = 1, or K + 1 in a verifying speculative step) and at every token ([T, nL, D],
  computed only when a scheduled request asks for its prompt's states); they are read back to the host
  only for the requests that ask.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.core.validation import InvalidParam
from jaxpaged.step.features import StepFeature


def check_layers(name: str, layers, num_layers: int, upper: int) -> tuple[int, ...]:
    """`layers` (None or distinct integer indices in [0, upper]) as a tuple; ValueError naming `name`."""
    if layers is None:
        return ()
    ok = isinstance(layers, (list, tuple)) and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                   for i in layers)
    if not ok or len(set(layers)) != len(layers) or not all(0 <= i <= upper for i in layers):
        raise ValueError(f"{name} must be a list of distinct layer indices in [0, {upper}] (the model has "
                         f"num_layers={num_layers}; 0 = embeddings), got {layers!r}")
    return tuple(int(i) for i in layers)


def check_params(params, capture: tuple, steer: tuple, hidden_size: int) -> None:
    """Check a request's research fields against what the engine compiled; InvalidParam names the field."""
    for name in ("return_hidden_states", "return_prompt_hidden_states"):
        if getattr(params, name) and not capture:
            raise InvalidParam(name, f"{name} needs hidden-state capture compiled in: start the engine with "
                                     "hidden_state_layers=[...]")
    for layer, vec in (params.steering_vectors or {}).items():
        if layer not in steer:
            raise InvalidParam("steering_vectors", f"steering_vectors: layer {layer} is not compiled for "
                                                   f"steering (steering_layers={list(steer)})")
        if vec.shape != (hidden_size,):
            raise InvalidParam("steering_vectors", f"steering_vectors[{layer}] has {vec.size} values, the "
                                                   f"model's hidden size is {hidden_size}")


class SlotHooks(StepFeature):
    """Per-slot research settings on the host (numpy): steering vectors and who wants hidden states; the
    runner's feature for them (step/features.py).

    Written by `join` when a request takes a slot (PersistentBatch calls it); the [S, nS, D] vectors are
    placed on the device again (`place(host array)`) only when a join changed them."""

    def __init__(self, max_num_seqs: int, capture: tuple, steer: tuple, hidden_size: int, dtype, place):
        S = max_num_seqs
        self.capture, self.steer, self.place = capture, steer, place
        self.vectors = np.zeros((S, len(steer), hidden_size), dtype)  # [S, nS, D]
        self.steered = np.zeros(S, np.bool_)          # [S] the row holds non-zero vectors
        self.wants_hidden = np.zeros(S, np.bool_)     # [S] return_hidden_states or return_prompt_hidden_states
        self.wants_prompt = np.zeros(S, np.bool_)     # [S] return_prompt_hidden_states
        self._device, self._dirty = None, True

    def join(self, s: int, req) -> None:
        p = req.params
        self.wants_hidden[s] = p.return_hidden_states or p.return_prompt_hidden_states
        self.wants_prompt[s] = p.return_prompt_hidden_states
        if p.steering_vectors or self.steered[s]:
            self.vectors[s] = 0
            for layer, vec in (p.steering_vectors or {}).items():
                self.vectors[s, self.steer.index(layer)] = vec
            self.steered[s], self._dirty = bool(p.steering_vectors), True

    def inputs(self, out, slots, T, batch, sp):
        """steering [S, nS, D] (on the device) and any_prompt_hidden; returns `plan`'s read-back plan."""
        if self.steer:
            if self._dirty:
                self._device, self._dirty = self.place(self.vectors), False
            sp["steering"] = self._device
        if self.capture:
            sp["any_prompt_hidden"] = np.bool_(self.wants_prompt[slots].any())
            return self.plan(out.scheduled, slots)
        return None

    def plan(self, scheduled, slots) -> list[tuple]:
        """What to read back after a step: (request, slot, sampled token index or None, first packed row,
        first prompt position, prompt rows) for each scheduled request that asks for hidden states."""
        if not self.wants_hidden[slots].any():
            return []
        out, row = [], 0
        for req, n in scheduled:
            s, c = req.slot, req.num_computed_tokens
            if self.wants_hidden[s]:
                token = len(req.token_ids) if c + n >= len(req.token_ids) and req.params.return_hidden_states \
                    else None
                m = max(0, min(c + n, req.num_prompt_tokens) - c) if self.wants_prompt[s] else 0
                out.append((req, s, token, row, c, m))
            row += n
        return out

    # -- inside the step (traced) ---------------------------------------------------------------------
    def decoder_args(self, batch: dict, sp: dict) -> dict:
        """The decoder's hook arguments: per-token steering vectors [T, nS, D] from the per-slot ones."""
        if not self.steer:
            return dict(capture=self.capture)
        T, S = batch["input_ids"].shape[0], sp["steering"].shape[0]
        slot = jnp.searchsorted(batch["query_start_loc"], jnp.arange(T), side="right") - 1  # [T]
        return dict(capture=self.capture, steer=self.steer, steering=sp["steering"][jnp.clip(slot, 0, S - 1)])

    def outputs(self, traced) -> tuple:
        """(f32[S, N, nL, D] at the rows of each slot's N tokens of this step, f32[T, nL, D] at every token
        when a request asks for its prompt's states, else zeros)."""
        if not self.capture:
            return ()
        st = traced.decoded["states"]  # [T, nL, D]
        every = jax.lax.cond(traced.sp["any_prompt_hidden"], lambda a: a.astype(jnp.float32),
                             lambda a: jnp.zeros(a.shape, jnp.float32), st)
        return st[traced.rows].astype(jnp.float32), every

    # -- after the step ---------------------------------------------------------------------------------
    def read(self, plan, outputs, step) -> None:
        """Store a finished step's states on its requests: each new token's (one per slot, or with
        speculative decoding the accepted proposals' and the next token's) and the prompt's asked for."""
        plan = [p for p in plan if not p[0].is_finished]  # finished meanwhile (async): its token is dropped
        if not plan:
            return
        rows = np.asarray(outputs[0])                     # [S, N, nL, D]
        new = (np.asarray(step.tokens).reshape(rows.shape[:2]) >= 0).sum(axis=1)  # [S] tokens of each slot
        every = np.asarray(outputs[1]) if any(p[5] for p in plan) else None  # [T, nL, D]
        for req, s, token, row, pos, m in plan:
            if token is not None:
                for j in range(new[s]):
                    req.hidden_states[token + j] = rows[s, j]
            if m:
                if req.prompt_hidden_states is None:
                    req.prompt_hidden_states = np.zeros((req.num_prompt_tokens,) + rows.shape[2:], np.float32)
                req.prompt_hidden_states[pos:pos + m] = every[row:row + m]

