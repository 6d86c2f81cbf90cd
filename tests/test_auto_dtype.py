"""dtype="auto" follows the checkpoint's published dtype (config.json's torch_dtype) where the hardware
computes in it: on CPU, bfloat16 only where the CPU has bfloat16 units (jaxpaged/config.py auto_dtype)."""
import json

import pytest

from jaxpaged import config
from jaxpaged.checkpoints import default_model
from jaxpaged.config import EngineConfig, auto_dtype


def _model(tmp_path, **fields) -> str:
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


@pytest.mark.parametrize("units", [True, False])
@pytest.mark.parametrize("published, want_with_units", [
    ({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "bfloat16"}, "bfloat16"),  # transformers 5's key
    ({"torch_dtype": "float16"}, "bfloat16"), ({"torch_dtype": "float32"}, "float32"), ({}, "float32")])
def test_cpu_follows_the_checkpoint_where_bfloat16_is_native(tmp_path, monkeypatch, units, published,
                                                            want_with_units):
    monkeypatch.setattr(config, "cpu_has_bfloat16", lambda: units)
    path = _model(tmp_path, **published)
    want = want_with_units if units else "float32"  # emulated bfloat16 is slower than float32
    assert auto_dtype(path) == want
    assert EngineConfig(model=path).dtype == want
    assert EngineConfig(model=path, dtype="float32").dtype == "float32"  # asked for: kept


def test_the_default_model_is_published_in_bfloat16(monkeypatch):
    """SmolLM2-135M-Instruct's checkpoint is bfloat16; its GGUF says nothing, so the conversion records
    it, and model=None resolves without fetching the model."""
    assert default_model.TORCH_DTYPE == "bfloat16"
    monkeypatch.setattr(config, "cpu_has_bfloat16", lambda: True)
    assert auto_dtype(None) == "bfloat16"
    monkeypatch.setattr(config, "cpu_has_bfloat16", lambda: False)
    assert auto_dtype(None) == "float32"


def test_an_unreadable_config_leaves_the_error_to_loading(tmp_path):
    (tmp_path / "config.json").write_text("not json")
    assert auto_dtype(str(tmp_path)) == "float32"
    assert auto_dtype(str(tmp_path / "missing")) == "float32"


def test_cpu_flags_are_read_from_cpuinfo(monkeypatch, tmp_path):
    """x86 AVX512-BF16 or AMX-BF16, or Arm BF16, in /proc/cpuinfo's flags."""
    import builtins
    real_open = builtins.open
    for flags, want in (("fpu avx2 avx512f", False), ("avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True),
                        ("Features : fp asimd bf16 i8mm", True)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"flags : {flags}\n")
        monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p,
                                                                           *a, **k))
        assert config.cpu_has_bfloat16() is want, flags
