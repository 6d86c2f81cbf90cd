"""The W8A8 copy the throughput bench hands vLLM (jaxpaged/bench/w8a8.py): codes and scales per output channel,
only the decoder's projections quantized, compressed-tensors' config, a sharded index kept whole."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged.bench import w8a8


def test_quantize_rows_round_trip_per_channel():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 40)).astype(np.float32) * np.arange(1, 7, dtype=np.float32)[:, None]
    w[3] = 0.0  # an all-zero row: scale 1, codes 0
    q, s = w8a8.quantize_rows(w)
    assert q.dtype == np.int8 and q.shape == (6, 40) and s.shape == (6, 1) and s.dtype == np.float32
    np.testing.assert_allclose(s[:, 0], np.where(np.abs(w).max(1) > 0, np.abs(w).max(1) / 127, 1.0), rtol=1e-7)
    assert np.abs(q).max() == 127 and (q[3] == 0).all()
    assert np.abs(q * s - w).max(axis=1).tolist() <= (s[:, 0] / 2 * (1 + 1e-6)).tolist()


def test_quantize_rows_refuses_nan():
    w = np.ones((2, 4), np.float32)
    w[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or infinity"):
        w8a8.quantize_rows(w)


def _model(tmp_path, sharded: bool) -> str:
    src = tmp_path / "m"
    src.mkdir()
    rng = np.random.default_rng(1)
    t = {"model.embed_tokens.weight": rng.normal(size=(10, 8)).astype(np.float32),
         "model.layers.0.input_layernorm.weight": np.ones(8, np.float32),
         "model.layers.0.self_attn.q_proj.weight": rng.normal(size=(8, 8)).astype(np.float32),
         "model.layers.0.mlp.down_proj.weight": rng.normal(size=(8, 16)).astype(np.float32)}
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    if not sharded:
        save_file(t, str(src / "model.safetensors"))
        return str(src)
    names = sorted(t)
    save_file({k: t[k] for k in names[:2]}, str(src / "model-00001-of-00002.safetensors"))
    save_file({k: t[k] for k in names[2:]}, str(src / "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" if i < 2 else "model-00002-of-00002.safetensors"
          for i, k in enumerate(names)}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return str(src)


@pytest.mark.parametrize("sharded", [False, True])
def test_w8a8_dir(tmp_path, sharded):
    src = _model(tmp_path, sharded)
    out = w8a8.w8a8_dir(src)
    assert out == src + "-w8a8" and w8a8.w8a8_dir(src) == out  # written once
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "llama" and cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    got = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            got.update(load_file(os.path.join(out, f)))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert got[name].dtype == np.int8 and got[name + "_scale"].shape == (got[name].shape[0], 1)
    assert got["model.embed_tokens.weight"].dtype == np.float32
    assert "model.layers.0.input_layernorm.weight_scale" not in got
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    if sharded:  # every tensor, scales included, named in the index where it lives
        wm = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
        assert set(wm) == set(got)
        for k, f in wm.items():
            assert k in load_file(os.path.join(out, f))


def test_w8a8_dir_refuses_a_model_without_projections(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    save_file({"embed.weight": np.ones((2, 2), np.float32)}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no decoder projection"):
        w8a8.w8a8_dir(str(src))
