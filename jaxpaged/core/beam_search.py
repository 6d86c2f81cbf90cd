"""Beam search as vLLM's (`LLM.beam_search`, `use_beam_search` on the server): the host bookkeeping.

Like vLLM, beam search runs in front of the engine, one token per iteration: each live beam of each prompt
is one engine request whose prompt is the beam's tokens, with max_tokens=1 and logprobs=2*beam_width, and
the returned top logprobs are the beam's candidate continuations. The candidates of all of a prompt's
beams are ranked by cumulative logprob: an EOS candidate (unless ignore_eos) finishes a beam ("stop") and
is kept aside, the beam_width best others are the next iteration's beams. After max_tokens iterations (or
at max_model_len: "length") the finished and live beams are ranked by `get_beam_search_score` (cumulative
logprob over length ** length_penalty, an ending EOS not counted) and the beam_width best are returned.

Forking does not recompute the prompt: a child beam's request holds its parent's tokens, so the engine's
prefix cache hands it the parent's full blocks (shared by reference count, jaxpaged/core/block_manager.py)
and computes only the tokens after the last full block (1 to block_size of them: the parent's partial
last block and the new token); only a prefix the pool evicted meanwhile (LRU, under memory pressure) is
computed again. See docs/server.md ("Beam search") for why the partial block is recomputed rather than
copied.

Host code, no jax.
"""
from __future__ import annotations

import functools
import logging
import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, field

from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.validation import InvalidParam

logger = logging.getLogger(__name__)


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams. `temperature` is that of each step's request: with the default
    logprobs_mode (raw_logprobs) the candidates' logprobs are the model's whatever it is, and a token sampled
    outside the top 2 * beam_width joins the candidates (as in vLLM); 0 makes the search deterministic.
    `include_stop_str_in_output`: `BeamSearch.generated` (the server's text and token_ids) keeps a finishing
    EOS."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise InvalidParam(name, f"BeamSearchParams.{name} must be an integer >= 1, got {v!r}")
        for name, lo in (("temperature", 0.0), ("length_penalty", -math.inf)):
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < lo:
                raise InvalidParam(name, f"BeamSearchParams.{name} must be a finite number"
                                         f"{' >= 0' if lo == 0 else ''}, got {v!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones (a finishing EOS included), `logprobs` the
    top logprobs of each generated position, `text` filled when returned."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length"
    stop_reason: int | None = None    # the EOS id that finished it


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's (after HF transformers'): cumulative logprob / length ** length_penalty, the length counting
    the prompt and not an ending EOS."""
    eos = eos_token_id if isinstance(eos_token_id, Collection) else (eos_token_id,)
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    try:
        return cumulative_logprob / (seq_len ** length_penalty)
    except OverflowError:  # the length's power is past float's range: the score is 0
        return 0.0
    except ZeroDivisionError:  # ... or below it
        return -math.inf if cumulative_logprob < 0 else 0.0


@functools.cache
def _warn_recompute() -> None:
    logger.warning("beam search without the prefix cache (enable_prefix_caching=False) recomputes every beam's "
                   "prompt and generated tokens at every iteration: enable it to compute only the new blocks")


def check_beam_search(params: BeamSearchParams, logprobs_mode: str, max_logprobs: int,
                      prefix_caching: bool = True) -> None:
    """Refuse (ValueError) a search the engine cannot run: candidates ranked by logprob need logprobs (not
    logits), 2 * beam_width of them a step. Without the prefix cache (`prefix_caching` False) a search
    recomputes each beam's whole sequence every iteration: one warning a process says so."""
    if not prefix_caching:
        _warn_recompute()
    if not logprobs_mode.endswith("logprobs"):
        raise ValueError(f"beam search ranks logprobs; this engine's logprobs_mode is {logprobs_mode}")
    if 2 * params.beam_width > max_logprobs:
        raise InvalidParam("beam_width", f"beam_width ({params.beam_width}) must be at most max_logprobs / 2 "
                                         f"({max_logprobs // 2}): each step asks for the top 2 * beam_width logprobs")


def candidates(out) -> dict[int, float] | None:
    """The candidates a beam's one-token request returned: its top logprobs (None: no output, or none)."""
    if out is None or not out.outputs[0].logprobs:
        return None
    return out.outputs[0].logprobs[0]


class _Instance:
    """One prompt's search: its live beams, the finished ones, the length its beams stop at."""

    def __init__(self, prompt: list[int], limit: int):
        self.prompt_len, self.limit = len(prompt), limit
        self.beams = [BeamSearchSequence(list(prompt))] if len(prompt) < limit else []
        self.completed: list[BeamSearchSequence] = []


class BeamSearch:
    """The search over several prompts: `pending()` the token lists to run one step on, `advance(...)` with
    their top logprobs, until `done`; then `outputs(tokenizer)`."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: Collection[int],
                 max_model_len: int):
        self.params, self.eos = params, frozenset(() if params.ignore_eos else eos_token_ids)
        self.all_eos = frozenset(eos_token_ids)
        self.instances = [_Instance(p, min(len(p) + params.max_tokens, max_model_len)) for p in prompts]

    def step_params(self) -> SamplingParams:
        """Each iteration's request: one token and the top 2 * beam_width logprobs (the candidates)."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.params.beam_width,
                              temperature=self.params.temperature, ignore_eos=True)

    @property
    def done(self) -> bool:
        return not any(inst.beams for inst in self.instances)

    def pending(self) -> list[tuple[int, list[int]]]:
        """(prompt index, tokens) of every live beam, prompt by prompt: the requests of this iteration."""
        return [(i, b.tokens) for i, inst in enumerate(self.instances) for b in inst.beams]

    def advance(self, logprobs: list[dict[int, float] | None]) -> None:
        """One iteration: `logprobs[j]` is the top logprobs of `pending()[j]`'s next token (None: the beam
        ended without one, as vLLM's aborted steps; it is dropped)."""
        if len(logprobs) != sum(len(inst.beams) for inst in self.instances):
            raise ValueError(f"{len(logprobs)} logprobs for {len(self.pending())} beams")
        it, width = iter(logprobs), self.params.beam_width
        for inst in self.instances:
            cands = []  # (cumulative logprob, beam, token, its logprobs)
            for beam in inst.beams:
                lp = next(it)
                for tok, v in (lp or {}).items():
                    cum = beam.cum_logprob + v
                    if tok in self.eos:
                        inst.completed.append(BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [lp], cum,
                                                                 finish_reason="stop", stop_reason=tok))
                    else:
                        cands.append((cum, beam, tok, lp))
            cands.sort(key=lambda c: -c[0])  # stable: ties keep the beams' and logprobs' order
            inst.beams = [BeamSearchSequence(b.tokens + [t], b.logprobs + [lp], cum) for cum, b, t, lp in cands[:width]]
            if inst.beams and len(inst.beams[0].tokens) >= inst.limit:  # max_tokens or max_model_len
                for b in inst.beams:
                    b.finish_reason = "length"
                inst.completed += inst.beams
                inst.beams = []
            # a finished beam outside the best beam_width finished ones can never be returned: drop it
            inst.completed = sorted(inst.completed, key=self._score, reverse=True)[:width]

    def _score(self, seq: BeamSearchSequence) -> float:
        return get_beam_search_score(seq.tokens, seq.cum_logprob, self.all_eos, self.params.length_penalty)

    def best(self) -> list[list[BeamSearchSequence]]:
        """Each prompt's beam_width best sequences (finished and live ones), best first."""
        out = []
        for inst in self.instances:
            done = sorted(inst.completed + inst.beams, key=self._score, reverse=True)[:self.params.beam_width]
            for s in done:
                s.finish_reason = s.finish_reason or "length"
            out.append(done)
        return out

    def outputs(self, tokenizer) -> list[BeamSearchOutput]:
        """`best()` as vLLM's LLM.beam_search returns it: each sequence's text is its whole token list (prompt
        included) decoded, special tokens kept (None without a tokenizer)."""
        out = []
        for seqs in self.best():
            for s in seqs:
                s.text = tokenizer.decode(s.tokens, skip_special_tokens=False) if tokenizer is not None else None
            out.append(BeamSearchOutput(seqs))
        return out

    def generated(self, index: int, seq: BeamSearchSequence) -> list[int]:
        """The generated token ids of prompt `index`'s sequence, a finishing EOS only with
        include_stop_str_in_output (the server's token_ids and text, as vLLM's)."""
        ids = seq.tokens[self.instances[index].prompt_len:]
        if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            ids = ids[:-1]
        return ids
