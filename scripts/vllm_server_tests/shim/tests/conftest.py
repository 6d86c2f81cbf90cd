"""The fixtures vLLM's server tests take from vLLM's `tests/conftest.py`, for a run against `jaxpaged serve`
(scripts/vllm_server_tests/README.md), offline: model ids resolve to the served model's directory (its
tokenizer and config), the sample constraints are our own, and what needs a download (LoRA adapters,
Hugging Face runners, image assets) skips with the reason."""
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
    """Named by tests that serve images to a multimodal model (none is served here)."""


def _needs_download(what: str):
    pytest.skip(f"needs {what} downloaded (offline harness)")


@pytest.fixture
def local_asset_server():
    _needs_download("vLLM's image assets")


@pytest.fixture(scope="session")
def hf_runner():
    _needs_download("a Hugging Face model for HfRunner")


for _name in ("qwen3_lora_files", "qwen3_meowing_lora_files", "qwen3_woofing_lora_files", "zephyr_lora_files",
              "opt125_lora_files"):
    def _lora(_n=_name):
        _needs_download(f"a LoRA adapter ({_n})")
    globals()[_name] = pytest.fixture(scope="session", name=_name)(_lora)


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
