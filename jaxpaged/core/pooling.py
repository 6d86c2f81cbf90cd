"""Pooling, the host half: the engine's pooler config, a request's pooling, and what `LLM.embed` and
`LLM.pair_score` hand back (vLLM's names and shapes).

An engine started with `runner="pooling"` (or `convert="embed"`) serves embeddings: a request whose
`SamplingParams.pooling` is set computes its prompt (chunked like any prefill), the runner feature
`jaxpaged/step/pooling.py` reads back the pooled final-norm hidden state, and the request finishes after its
prefill (`max_tokens` 1: no KV block is computed past the prompt). The pooling type is the engine's
(`pooler_config`), normalization per request (default the engine's).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # the last prompt token's state, the mean over the prompt, the first's
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `--pooler-config` (JSON): `pooling_type` LAST | MEAN | CLS and `normalize` (L2, also under
    vLLM's newer name `use_activation`)."""
    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, value) -> "PoolerConfig":
        """A PoolerConfig from None (the defaults), a dict, a JSON string or a PoolerConfig; ValueError naming
        pooler_config and the key otherwise."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a dict or JSON object, got {value!r}")
        unknown = set(value) - {"pooling_type", "normalize", "use_activation"}
        if unknown:
            raise ValueError(f"pooler_config: unsupported key(s) {sorted(unknown)} (supported: pooling_type, "
                             "normalize / use_activation)")
        kind = value.get("pooling_type") or "LAST"
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
        norm = value.get("normalize", value.get("use_activation"))
        if norm is not None and not isinstance(norm, bool):
            raise ValueError(f"pooler_config.normalize must be a bool, got {norm!r}")
        return cls(kind, True if norm is None else norm)


def pooling_enabled(runner: str, convert: str) -> bool:
    """Whether an engine of these `runner` / `convert` flags pools (ValueError naming the flag if unknown)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)} (classify and reward models are not "
                         f"supported), got {convert!r}")
    if runner == "generate" and convert == "embed":
        raise ValueError("convert='embed' needs runner 'pooling' or 'auto', got runner='generate'")
    return runner == "pooling" or convert == "embed"


@dataclass(frozen=True)
class Pooling:
    """A request's pooling (SamplingParams.pooling): the engine's type, and whether to L2-normalize."""
    type: str
    normalize: bool

    @property
    def every_position(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip: such requests compute the whole prompt."""
        return self.type != "LAST"

    def finish(self, pooled: np.ndarray, num_tokens: int) -> np.ndarray:
        """The request's vector, f32[D], from what the step read back (MEAN: the sum over its tokens)."""
        v = pooled / num_tokens if self.type == "MEAN" else pooled
        if self.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32)


@dataclass
class PoolingParams:
    """vLLM's per-request pooling parameters: `normalize` (None: the engine's pooler config);
    `dimensions` (matryoshka truncation) is refused: no model here is trained for it."""
    normalize: bool | None = None
    dimensions: int | None = None

    def resolve(self, config: PoolerConfig) -> Pooling:
        if self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions is not supported (the model is not a matryoshka model)")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be a bool or None, got {self.normalize!r}")
        return Pooling(config.pooling_type, config.normalize if self.normalize is None else self.normalize)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled vector, [hidden_size]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's (`.outputs.embedding`)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score, as vLLM's (`.outputs.score`): the cosine similarity of the two embeddings."""
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)  # the pair's, one after the other
    outputs: ScoringOutput = field(default_factory=lambda: ScoringOutput(0.0))
    finished: bool = True


def cosine(a, b) -> float:
    """The cosine similarity of two vectors (0 where one is zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / d) if d > 0 else 0.0


def pairs(data_1, data_2) -> list[tuple[int, int]]:
    """The (index in data_1, index in data_2) pairs vLLM's score forms: one against many, or one to one."""
    n1, n2 = len(data_1), len(data_2)
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 != n2:
        raise ValueError(f"data_1 has {n1} items and data_2 {n2}: give one item, or as many as data_2")
    return [(i, i) for i in range(n1)]
