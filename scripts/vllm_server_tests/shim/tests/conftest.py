"""The fixtures vLLM's server tests take from vLLM's `tests/conftest.py`, for a run against `jaxpaged serve`
(scripts/vllm_server_tests/README.md), offline: model ids resolve to the served model's directory (its
tokenizer and config), the sample constraints are our own, LoRA adapters are random ones of the served model
made here, and what needs another download (Hugging Face runners, image assets) skips with the reason."""
from __future__ import annotations

import os

import pytest

MODEL_DIR = os.environ.get("JAXPAGED_MODEL_DIR", "")


def _local(name, *args, **kwargs):
    """A Hugging Face id (not a directory) -> the served model's directory."""
    return (name if isinstance(name, str) and os.path.isdir(name) else MODEL_DIR), args, kwargs


def _redirect(cls, method: str = "from_pretrained") -> None:
    real = getattr(cls, method).__func__

    def local(c, name, *args, **kwargs):
        name, args, kwargs = _local(name, *args, **kwargs)
        return real(c, name, *args, **kwargs)
    setattr(cls, method, classmethod(local))


def _patch_tokenizers() -> None:
    import transformers
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig):
        _redirect(cls)
    import importlib
    for mod_name in ("vllm.tokenizers", "vllm.transformers_utils.tokenizer"):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        real = getattr(mod, "get_tokenizer", None)
        if real is not None:
            def get_tokenizer(name=None, *args, _real=real, **kwargs):
                if "tokenizer_name" in kwargs:
                    kwargs["tokenizer_name"] = _local(kwargs["tokenizer_name"])[0]
                    return _real(*args, **kwargs)
                return _real(_local(name)[0], *args, **kwargs)
            mod.get_tokenizer = get_tokenizer
    try:  # vLLM's ModelConfig(model=ID) (tests read the vocabulary size from it)
        from vllm.config import ModelConfig
    except ImportError:
        return
    real_init = ModelConfig.__init__

    def init(self, *args, **kwargs):
        if "model" in kwargs:
            kwargs["model"] = _local(kwargs["model"])[0]
        real_init(self, *args, **kwargs)
    ModelConfig.__init__ = init


def _patch_metrics() -> None:
    """jaxpaged's metrics carry vLLM's names under its own prefix: a scrape reads `jaxpaged:` as `vllm:`."""
    import requests
    real = requests.get

    def get(url, *args, **kwargs):
        r = real(url, *args, **kwargs)
        if str(url).rstrip("/").endswith("/metrics"):
            r._content = r.content.replace(b"jaxpaged:", b"vllm:")
        return r
    requests.get = get


if MODEL_DIR:
    _patch_tokenizers()
_patch_metrics()


class LocalAssetServer:
    """Named by tests that serve images to a multimodal model: none is served here, so a test that asks for
    an image's address skips (one that takes the fixture and sends text runs)."""

    def url_for(self, *names: str) -> str:
        _needs_download("vLLM's image assets")


def _needs_download(what: str):
    pytest.skip(f"needs {what} downloaded (offline harness)")


@pytest.fixture
def local_asset_server():
    return LocalAssetServer()


@pytest.fixture(scope="session")
def hf_runner():
    _needs_download("a Hugging Face model for HfRunner")


def make_lora_adapter(path: str, seed: int, r: int = 8) -> str:
    """A PEFT LoRA adapter of the served model (random A and B on q_proj and v_proj, rank `r`) in `path`.

    It stands for the adapters vLLM's tests download: their names and rank, not their trained behaviour."""
    import json

    import torch
    from safetensors.torch import save_file
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        cfg = json.load(f)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "v_proj": cfg.get("num_key_value_heads", heads) * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for mod, out in outs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, hidden, generator=g) * 0.05  # [r, hidden]
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.05  # [out, r]
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
                   "target_modules": sorted(outs), "bias": "none", "use_dora": False, "modules_to_save": None,
                   "base_model_name_or_path": MODEL_DIR}, f)
    return path


LORA_REPOS = {"charent/self_cognition_Alice", "Jackmin108/Qwen3-0.6B-Meow-LoRA", "Jackmin108/Qwen3-0.6B-Woof-LoRA",
              "peft-internal-testing/opt-125m-dummy-lora", "typeof/zephyr-7b-beta-lora"}  # vLLM's tests' adapters


def _patch_snapshot_download() -> None:
    """vLLM's LoRA fixtures (`snapshot_download` of a repo in LORA_REPOS) get a local adapter, one per repo;
    any other download skips, offline."""
    import tempfile

    import huggingface_hub
    made: dict[str, str] = {}

    def snapshot_download(repo_id: str, *args, **kwargs):
        if not (MODEL_DIR and repo_id in LORA_REPOS):
            _needs_download(f"{repo_id} (snapshot_download)")
        if repo_id not in made:
            made[repo_id] = make_lora_adapter(tempfile.mkdtemp(prefix="lora-"), seed=200 + len(made))
        return made[repo_id]
    huggingface_hub.snapshot_download = snapshot_download


_patch_snapshot_download()


@pytest.fixture
def sample_json_schema():
    """An employee profile (the named-tool test compares `name` and `age` of two answers)."""
    return {"type": "object", "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 40},
                           "age": {"type": "integer", "minimum": 16, "maximum": 90},
                           "skills": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                      "maxItems": 4},
                           "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"}},
            "required": ["name", "age", "skills", "email"]}


@pytest.fixture
def sample_regex():
    """A dotted quad of 1-3 digit numbers."""
    return r"([0-9]{1,3}\.){3}[0-9]{1,3}"


@pytest.fixture
def sample_structured_outputs_choices():
    return ["Rust", "Haskell", "OCaml", "Ada", "Scala", "Swift", "Kotlin"]
