"""Checks of sampled tokens against an exact distribution (numpy only): the distribution a temperature, top-k and
top-p leave of a row of logits, the total variation of draws from it, and a bound that n honest draws exceed
with a small probability."""
from __future__ import annotations

import numpy as np


def filtered_softmax(logits: np.ndarray, temperature: float, top_p: float, top_k: int | None) -> np.ndarray:
    """f64[V]: softmax(logits / temperature) over the top k tokens (None or 0: all), then over the tokens whose
    preceding cumulative probability (among those k, largest first) is at most top_p, renormalised; the
    order of vLLM's, Tunix's `sample_top_p`'s and the engine's sampler. logits: [V] (-inf: masked)."""
    if temperature <= 0:
        raise ValueError(f"filtered_softmax: temperature must be > 0, got {temperature}")
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")[:top_k or len(z)]
    probs = np.exp(z[order] - z[order].max())
    probs /= probs.sum()
    kept = order[np.cumsum(probs) - probs <= top_p]
    p = np.zeros(len(z))
    p[kept] = np.exp(z[kept] - z[kept].max())
    return p / p.sum()


def tv(samples: np.ndarray, p: np.ndarray) -> float:
    """Total variation between the empirical distribution of token ids `samples` i32[n] and p f64[V]."""
    return float(np.abs(np.bincount(samples, minlength=len(p)) / len(samples) - p).sum() / 2)


def tv_bound(p: np.ndarray, n: int, delta: float = 1e-6) -> float:
    """A bound the total variation between p and the empirical distribution of n draws from it exceeds with
    probability < delta: E[TV] <= sum sqrt(p (1 - p) / n) / 2, and TV moves by at most 1/n per draw
    (McDiarmid: P(TV - E[TV] >= t) <= exp(-2 n t^2))."""
    return float(np.sqrt(p * (1 - p) / n).sum() / 2 + np.sqrt(np.log(1 / delta) / (2 * n)))
