"""The runner's features behind one seam: what each adds to the step's inputs, and what it reads back.

A feature of the step (research hooks, prompt logprobs, routed experts, logit controls, grammar masks, the
LoRA token index, ...) is a `StepFeature`. The runner holds a tuple of them, chosen once at start-up, and
knows none by name:

- host, at launch: `inputs(out, slots, T, batch, sp)` adds its arrays to the step's host inputs for one
  schedule (the compile-time inputs are the same call with an empty schedule) and returns its read-back
  plan: what to copy to the host after this step (falsy: nothing; a step where no scheduled request uses
  the feature reads nothing back);
- device, traced once per compiled variant: `decoder_args(batch, sp)` (keyword arguments of the decoder)
  and `outputs(traced)` (what the step returns for it, a tuple of arrays);
- host, at read: `read(plan, outputs, step)` with the plan made at launch; what it returns, if anything, is
  {slot: [{token id: logprob} per token row]}, entries the runner adds to the sampled tokens' logprobs.

The defaults do nothing, so a feature implements only its part, and a feature that is not in the tuple
adds no input and no output. How the step draws each slot's tokens is the variant's `Sampling` (the plain
sampler here; speculative decoding's verifier in spec_decode/step.py), which has the same host half.
Below: the features whose whole part is step inputs, over the host objects of core/ and lora/.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxpaged.core.step_result import Sampled
from jaxpaged.models.live_rows import live_rows
from jaxpaged.step.batch_invariant import row_tiled_sample
from jaxpaged.step.sampler import jnp_argmax, sample, slot_rows


@dataclass(frozen=True)
class Traced:
    """What a feature's `outputs` sees inside the step (traced arrays)."""
    batch: dict            # the step's batch arrays (input_ids [T], logits_indices [S], ...)
    sp: dict               # the sampling arrays, flags and device-resident inputs
    h: object              # f32[T, D] final hidden states
    decoded: dict          # the decoder's extra outputs by name: states [T, nL, D], routes i32[T, L, k]
    logits_of: Callable    # hidden [N, D] -> logits [N, V] (lm_head, sharding constraints)
    rows: object           # i32[S, N]: the row whose logits gave each slot's n-th token of this step


class StepFeature:
    """One feature of the step (module docstring); every method's default does nothing."""
    placeholders: dict = {}  # device arrays standing in for its inputs while unused (never mutated)

    def track(self, req) -> None:
        """Note an admitted request (a feature that skips steps scheduling none of its requests keeps it)."""

    def inputs(self, out, slots: list, T: int, batch: dict, sp: dict):
        """Add the step's host inputs for `out` (SchedulerOutput; `slots` of out.scheduled, T its bucket);
        return the read-back plan (falsy: nothing to read)."""
        return None

    def decoder_args(self, batch: dict, sp: dict) -> dict:
        return {}

    def outputs(self, traced: Traced) -> tuple:
        return ()

    def read(self, plan, outputs: tuple, step) -> dict | None:
        """Copy back what `plan` names of the step's `outputs` (host arrays on request); return None, or
        logprob entries to add to the sampled tokens' ({slot: [{token id: logprob} per token row]})."""


def decoded(args: dict, outs: list) -> dict:
    """The decoder's outputs after (h, k_pool, v_pool) by name, in its order: states with `capture`, then
    routes with `routes` (models/llama.py decoder)."""
    names = ["states"] * bool(args.get("capture")) + ["routes"] * bool(args.get("routes"))
    return dict(zip(names, outs))


def add_logprobs(result: dict, entries: dict) -> None:
    """Add a feature's logprob entries ({slot: [{token id: logprob} per token row]}) to a step's tokens
    (`Sampling.read_tokens`: slot -> Sampled), after those already there."""
    for slot, rows in entries.items():
        for lp, add in zip(result[slot].logprobs or (), rows):
            for t, v in add.items():
                lp.setdefault(t, v)


class Sampling(StepFeature):
    """The plain draw: one token per scheduled slot (and its logprobs), `sampler.sample` on the logits of
    each slot's last row; with batch invariance (row_tile) over row tiles of fixed shape."""

    def __init__(self, num_logprobs: int, logprobs_mode: str, row_tile: int = 0, argmax=jnp_argmax):
        self.num_logprobs, self.logprobs_mode, self.row_tile = num_logprobs, logprobs_mode, row_tile
        self.argmax = argmax  # the greedy rows' (sampler.sample): XLA's, or the CPU kernel's

    def draw(self, logits_of, h, batch: dict, sp: dict) -> tuple:
        """(tokens i32[R], logprob f32[R], top f32[R, NL], top ids i32[R, NL]) of the R sample_slots rows."""
        S, rows = batch["logits_indices"].shape[0], batch["sample_slots"]
        at = jnp.minimum(rows, S - 1)
        with live_rows(jnp.sum(rows < S, dtype=jnp.int32)):  # the advanced slots' rows lead, then padding
            logits = logits_of(h[batch["logits_indices"][at]])  # [R, V]
        draw = functools.partial(sample, num_logprobs=self.num_logprobs, logprobs_mode=self.logprobs_mode,
                                 argmax=self.argmax)
        if self.row_tile:  # batch invariance: the sampler's row reductions over tiles of fixed shape too
            return row_tiled_sample(draw, logits, slot_rows(sp, at, S), self.row_tile)
        return draw(logits, slot_rows(sp, at, S))  # a row's draw depends on its slot's seed only

    def token_rows(self, batch: dict):
        """i32[S, 1]: each slot's token comes from its last row."""
        return batch["logits_indices"][:, None]

    def read_tokens(self, step) -> dict[int, Sampled]:
        """slot -> Sampled([its token], [{token id: logprob}] or None) of a launched step (runner.Launched)."""
        tokens = np.asarray(step.tokens).tolist()
        result = {s: Sampled([tokens[s]], None) for s in step.slots}
        if not step.any_logprobs:
            return result
        want_lp = [(r, s) for (r, _), s in zip(step.out.scheduled, step.slots) if r.params.logprobs is not None]
        tok_lp, top_lp, top_ids = (np.asarray(a) for a in step.logprobs)
        for req, s in want_lp:
            k = req.params.logprobs
            lp = {int(i): float(v) for i, v in zip(top_ids[s, :k], top_lp[s, :k])}
            lp[tokens[s]] = float(tok_lp[s])
            result[s] = Sampled([tokens[s]], [lp])
        return result


class LoRAIndex(StepFeature):
    """Each token's adapter slot, lora_index i32[T] (jaxpaged/lora/slots.py; 0: the base model)."""

    def __init__(self, lora):
        self.lora = lora

    def inputs(self, out, slots, T, batch, sp):
        batch["lora_index"] = self.lora.token_index(out.scheduled, T)


class GrammarMask(StepFeature):
    """Structured outputs and allowed_token_ids: bitmask i32[S, W], any_mask (core/structured.py)."""

    def __init__(self, structured, max_num_seqs: int, place):
        self.structured, self.max_num_seqs = structured, max_num_seqs
        structured.all_ones = place(structured.all_ones)  # stays on the device
        self.placeholders = dict(bitmask=structured.all_ones)

    def inputs(self, out, slots, T, batch, sp):
        sp.update(self.structured.bitmask_arrays(out.scheduled, self.max_num_seqs))


class LogitBias(StepFeature):
    """logit_bias and bad_words: bias_ids i32[S, NB], bias_values f32[S, NB], any_bias
    (core/logit_controls.py); steps scheduling none of the requests that use them cost one check."""

    def __init__(self, controls, place):
        self.controls = controls
        controls.none = self.placeholders = {k: place(v) for k, v in controls.none.items()}

    def track(self, req) -> None:
        if req.params.logit_bias or req.bad_words_token_ids:
            self.controls.requests.add(req)

    def inputs(self, out, slots, T, batch, sp):
        sp.update(self.controls.arrays(out.scheduled))
