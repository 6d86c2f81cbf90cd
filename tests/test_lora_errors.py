"""Every adapter we cannot run is refused at load, by a ValueError naming what is wrong (no engine)."""
import json
import shutil

import numpy as np
import pytest
from lora_adapters import make_adapter
from safetensors.numpy import load_file, save_file

from jaxpaged import ModelConfig
from jaxpaged.lora.peft import load_peft
from jaxpaged.testing.tiny_models import make_tiny_model

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_errors")
    base = make_tiny_model(str(root / "base"), "llama", seed=4)
    return base, make_adapter(str(root / "good"), base, r=4)


def _variant(good, tmp_path, config=None, tensors=None, drop=()):
    """A copy of the good adapter with config fields / tensors changed (None values delete)."""
    _, src = good
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    t = load_file(str(dst / "adapter_model.safetensors"))
    t.update(tensors or {})
    for k in drop:
        t.pop(k)
    save_file(t, str(dst / "adapter_model.safetensors"))
    return str(dst)


CONFIG_CASES = {
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "only supports modules_to_save being None"),
    "dora": ({"use_dora": True}, "does not yet support DoRA"),
    "bias": ({"bias": "all"}, "bias 'all'"),
    "rank": ({"r": 32}, "LoRA rank 32 is greater than max_lora_rank 16"),
    "embedding_target": ({"target_modules": ["q_proj", "embed_tokens"]}, "target module 'embed_tokens'"),
    "lm_head_target": ({"target_modules": ["lm_head"]}, "target module 'lm_head'"),
    "fused_on_llama": ({"target_modules": ["qkv_proj"]}, "target module 'qkv_proj'"),
    "peft_type": ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING'"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config(good, tmp_path, case):
    config, msg = CONFIG_CASES[case]
    path = _variant(good, tmp_path, config=config)
    with pytest.raises(ValueError, match=msg):
        load_peft(path, ModelConfig.from_dir(good[0]), 16, "float32")


TENSOR_CASES = {
    "lm_head": ({"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}, "lm_head adapter"),
    "embedding": ({"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 256), np.float32)},
                  "embedding adapter"),
    "dora": ({f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector": np.zeros(64, np.float32)}, "DoRA"),
    "shape": ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 65), np.float32)},
              r"has shape \[4, 65\], the model needs \[4, 64\]"),
    "layer": ({f"{PREFIX}.7.self_attn.q_proj.lora_A.weight": np.zeros((4, 64), np.float32)},
              r"layer 7 >= num_layers \(2\)"),
    "module": ({f"{PREFIX}.0.self_attn.rotary.lora_A.weight": np.zeros((4, 64), np.float32)},
               "no target module 'rotary'"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_bad_tensor(good, tmp_path, case):
    tensors, msg = TENSOR_CASES[case]
    path = _variant(good, tmp_path, tensors=tensors)
    with pytest.raises(ValueError, match=msg):
        load_peft(path, ModelConfig.from_dir(good[0]), 16, "float32")


def test_bad_files(good, tmp_path):
    cfg = ModelConfig.from_dir(good[0])
    with pytest.raises(ValueError, match="is not a directory"):
        load_peft(str(tmp_path / "missing"), cfg, 16, "float32")
    path = _variant(good, tmp_path)
    (tmp_path / "bad" / "adapter_model.safetensors").rename(tmp_path / "bad" / "adapter_model.bin")
    with pytest.raises(ValueError, match="adapter_model.bin"):
        load_peft(path, cfg, 16, "float32")


@pytest.mark.parametrize("content,msg", [(b"", "is empty"), (b"{\"r\": 4,", "is not valid JSON .* line 1 column"),
                                         (b"\xff\xfe", "is not UTF-8"), (b"[1]", "must hold a JSON object, got list")])
def test_unreadable_config_names_the_file(good, tmp_path, content, msg):
    path = _variant(good, tmp_path)
    (tmp_path / "bad" / "adapter_config.json").write_bytes(content)
    with pytest.raises(ValueError, match=f"adapter_config.json: {msg}"):
        load_peft(path, ModelConfig.from_dir(good[0]), 16, "float32")


def test_mlp_targets_refused_on_experts(good, tmp_path):
    moe = ModelConfig.from_dir(make_tiny_model(str(tmp_path / "moe"), "mixtral", seed=1))
    path = _variant(good, tmp_path, config={"target_modules": ["q_proj", "gate_proj"]})
    with pytest.raises(ValueError, match="target module 'gate_proj' is not supported on this mixtral"):
        load_peft(path, moe, 16, "float32")


def test_good_adapter_loads(good):
    a = load_peft(good[1], ModelConfig.from_dir(good[0]), 16, "float32")
    assert a.rank == 4 and a.scaling == 2.0 and a.a["wq"].shape == (2, 64, 16) and a.b["w_down"].shape == (2, 16, 64)
    assert np.abs(a.a["wq"][:, :, :4]).min() > 0 and not a.a["wq"][:, :, 4:].any()  # padded with zeros
