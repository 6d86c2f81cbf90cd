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
    """Refuse, by name, the engine settings speculation does not compose with (EngineConfig, validated)."""
    refused = [("async_scheduling", cfg.async_scheduling), ("tensor_parallel_size > 1", cfg.tensor_parallel_size > 1),
               ("data_parallel_size > 1", cfg.data_parallel_size > 1), ("num_processes > 1", cfg.num_processes > 1),
               ("hidden_state_layers", bool(cfg.hidden_state_layers)), ("steering_layers", bool(cfg.steering_layers)),
               ("enable_lora", cfg.enable_lora), ("batch_invariant", cfg.batch_invariant),
               ("logprobs_mode other than raw_logprobs", cfg.logprobs_mode != "raw_logprobs")]
    for name, on in refused:
        if on:
            raise ValueError(f"speculative_config is not supported with {name} (not verified yet)")


def check_request(params) -> None:
    """Refuse, by name, the sampling parameters speculation does not compose with (yet): each would need
    state that changes along the proposed positions (token history, grammar, hidden states)."""
    from jaxpaged.core.validation import InvalidParam
    refused = [("presence_penalty", params.presence_penalty != 0), ("frequency_penalty", params.frequency_penalty != 0),
               ("repetition_penalty", params.repetition_penalty != 1), ("bad_words", bool(params.bad_words)),
               ("structured_outputs", params.structured_outputs is not None), ("n", params.n > 1),
               ("allowed_token_ids", params.allowed_token_ids is not None),
               ("prompt_logprobs", params.prompt_logprobs is not None),
               ("return_hidden_states", bool(params.return_hidden_states)),
               ("return_prompt_hidden_states", bool(params.return_prompt_hidden_states)),
               ("return_routed_experts", bool(params.return_routed_experts))]
    for name, on in refused:
        if on:
            raise InvalidParam(name, f"{name} is not supported with speculative decoding (speculative_config)")


def check_draft_engine(cfg) -> None:
    """Refuse, by name, the engine settings a draft model does not compose with yet (its params and pool
    are placed on the target's mesh, but sharded or replicated drafts are not verified)."""
    refused = [("tensor_parallel_size > 1", cfg.tensor_parallel_size > 1),
               ("data_parallel_size > 1", cfg.data_parallel_size > 1), ("num_processes > 1", cfg.num_processes > 1)]
    for name, on in refused:
        if on:
            raise ValueError(f"speculative_config with method 'draft_model' is not supported with {name} "
                             "(not verified yet)")
