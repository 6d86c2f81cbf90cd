"""SpeculativeConfig: what `speculative_config={...}` (LLM, --speculative-config JSON) asks for, validated.

vLLM's names: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
"prompt_lookup_max": 5} and {"method": "draft_model", "model": DIR, "num_speculative_tokens": k}. Errors
name the field (`speculative_config.<field>`)."""
from __future__ import annotations

import json
from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 8
METHODS = ("ngram", "draft_model")
NOT_BUILT = {"eagle": "EAGLE heads are not supported (only methods 'ngram' and 'draft_model')",
             "eagle3": "EAGLE-3 heads are not supported (only methods 'ngram' and 'draft_model')",
             "mtp": "MTP heads are not supported (only methods 'ngram' and 'draft_model')"}
FIELDS = {"ngram": ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
          "draft_model": ("num_speculative_tokens", "model")}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4   # k: proposals per request and step
    prompt_lookup_min: int = 2        # n-gram: shortest suffix matched
    prompt_lookup_max: int = 5        # n-gram: longest suffix matched (tried first)
    model: str | None = None          # draft_model: the draft's directory (same vocabulary as the target)

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A dict, a JSON string, a SpeculativeConfig or None -> a validated config (or None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}")
        method = value.get("method", "ngram")
        if method in NOT_BUILT:
            raise ValueError(f"speculative_config.method {method!r}: {NOT_BUILT[method]}")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        unknown = sorted(set(value) - {"method", *FIELDS[method]})
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a known field of method {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if method == "draft_model" and not isinstance(value.get("model"), str):
            raise ValueError("speculative_config.model (the draft's directory) is required for method 'draft_model'")
        kw = {k: value[k] for k in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
              if k in value}
        for name, v in kw.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        cfg = cls(method=method, model=value.get("model"), **kw)
        if cfg.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most "
                             f"{MAX_SPECULATIVE_TOKENS}, got {cfg.num_speculative_tokens}")
        if cfg.prompt_lookup_max < cfg.prompt_lookup_min:
            raise ValueError(f"speculative_config.prompt_lookup_max ({cfg.prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({cfg.prompt_lookup_min})")
        return cfg


def check_engine(cfg) -> None:
    """Refuse, by name, the engine settings speculation does not compose with (EngineConfig, validated):
    async scheduling (the host needs each step's accepted tokens before it proposes the next) and
    batch_invariant (a speculative step's rows are not the plain step's row tiles)."""
    refused = [("async_scheduling", cfg.async_scheduling), ("batch_invariant", cfg.batch_invariant)]
    for name, on in refused:
        if on:
            raise ValueError(f"speculative_config is not supported with {name}")


def check_request(params) -> None:
    """Refuse, by name, the sampling parameters speculation does not compose with (yet)."""
    from jaxpaged.core.validation import InvalidParam
    if params.return_routed_experts:  # the routes of proposals would need rolling back like the pool
        raise InvalidParam("return_routed_experts", "return_routed_experts is not supported with speculative "
                           "decoding (speculative_config)")


def check_draft_engine(cfg) -> None:
    """Refuse, by name, the engine settings a draft model does not compose with yet: a multi-host job (the
    draft runs its own compiled function each step, which the followers' step message does not carry) and
    logprobs modes other than raw (its verifier reports raw logprobs of the tokens it outputs). Tensor and
    data parallelism compose: the draft's params and pool sit on each replica's mesh like the target's."""
    refused = [("num_processes > 1", cfg.num_processes > 1),
               ("logprobs_mode other than raw_logprobs", cfg.logprobs_mode != "raw_logprobs")]
    for name, on in refused:
        if on:
            raise ValueError(f"speculative_config with method 'draft_model' is not supported with {name}")
