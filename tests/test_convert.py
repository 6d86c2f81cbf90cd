"""Conversion: HF directory or GGUF file -> engine format; round trips and every bad input."""
import errno
import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxpaged import ModelConfig
from jaxpaged.checkpoints.convert import TOKENIZER_FILES, convert
from jaxpaged.checkpoints.weights import load_params
from jaxpaged.testing.gguf_files import write_gguf
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model

VOCAB = 300  # the tiny tokenizer's size


# -- helpers ------------------------------------------------------------------------------------
def _flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_trees_equal(got, want):
    got, want = _flat(got), _flat(want)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _hf_dir(path, family="llama", **kw):
    make_tiny_model(str(path), family, vocab_size=VOCAB, **kw)
    add_tiny_tokenizer(str(path), VOCAB)
    return str(path)


def _params(d, dtype="float32"):
    return load_params(d, ModelConfig.from_dir(d), dtype)


def _leftovers(parent, name):
    return [f for f in os.listdir(parent) if f.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _hf_dir(tmp_path_factory.mktemp("hf") / "llama", "llama")


# -- HF directory round trips ------------------------------------------------------------------
@pytest.mark.parametrize("family,kw", [("llama", {}), ("llama", {"tie": True}), ("mistral", {}),
                                       ("qwen2", {}), ("qwen3", {}),
                                       ("qwen2", {"max_shard_size": "40KB"}),
                                       ("llama", {"dtype": "bfloat16"})])
def test_hf_roundtrip_float32_bit_identical(tmp_path, family, kw):
    src = _hf_dir(tmp_path / "src", family, **kw)
    if "max_shard_size" in kw:
        assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
    dst = convert(src, str(tmp_path / "dst"), dtype="float32", progress=False)
    copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(src, f))]
    assert "tokenizer.json" in copied and sorted(os.listdir(dst)) == sorted(["config.json", "params"] + copied)
    for f in copied:
        assert open(os.path.join(src, f), "rb").read() == open(os.path.join(dst, f), "rb").read(), f
    with open(os.path.join(src, "config.json")) as a, open(os.path.join(dst, "config.json")) as b:
        assert json.load(a) == json.load(b)
    _assert_trees_equal(_params(dst), _params(src))
    assert _leftovers(tmp_path, "dst") == []


def test_hf_roundtrip_bfloat16_within_rounding(tmp_path, llama_dir):
    dst = convert(llama_dir, str(tmp_path / "dst"), progress=False)  # default dtype: bfloat16
    got, ref = _flat(_params(dst, "bfloat16")), _flat(_params(llama_dir))
    for k, want in ref.items():
        assert got[k].dtype == ml_dtypes.bfloat16, k
        np.testing.assert_array_equal(got[k], want.astype(ml_dtypes.bfloat16), err_msg=k)  # round to nearest
        np.testing.assert_allclose(got[k].astype(np.float32), want, rtol=2.0 ** -8, atol=0, err_msg=k)


def test_converted_dir_generates_like_hf(tmp_path, llama_dir, engine_kwargs):
    from oracle import hf_greedy

    from jaxpaged import LLM, SamplingParams
    dst = convert(llama_dir, str(tmp_path / "dst"), dtype="float32", progress=False)
    llm = LLM(model=dst, **{**engine_kwargs, "warmup": False})
    prompts = [llm.tokenizer.encode(p) for p in ("The quick brown fox", "Hello world!")]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(llama_dir, p, 8) for p in prompts]


def test_convert_command(tmp_path, llama_dir):
    """`jaxpaged convert SRC DST`: prints DST; refuses a non-empty DST without --force."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "jaxpaged.cli", "convert", llama_dir, str(tmp_path / "dst")]
    r = subprocess.run(cmd + ["--dtype", "float32"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "dst")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and "not empty" in r.stderr and "--force" in r.stderr


# -- GGUF --------------------------------------------------------------------------------------
def _hf_gguf_state(gguf_path):
    """transformers' own GGUF loader (the oracle): name -> float32 numpy."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                             dtype=torch.float32)
    return {k: v.numpy() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("family,qtype", [("llama", "F32"), ("llama", "F16"), ("llama", "BF16"),
                                          ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_1"),
                                          ("qwen2", "Q8_0"), ("qwen3", "F32")])
def test_gguf_tensors_match_transformers(tmp_path, family, qtype):
    from jaxpaged.checkpoints.gguf import GGUFModel
    src = _hf_dir(tmp_path / "hf", family)
    os.makedirs(tmp_path / "gguf")
    path = write_gguf(src, str(tmp_path / "gguf" / "m.gguf"), qtype)
    g = GGUFModel(path)
    ours = dict(g.tensors())
    want = _hf_gguf_state(path)
    assert set(ours) == set(want) - ({"lm_head.weight"} if g.config["tie_word_embeddings"] else set())
    for k, v in ours.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    dst = convert(path, str(tmp_path / "dst"), dtype="float32", progress=False)
    got, want = ModelConfig.from_dir(dst), ModelConfig.from_dir(src)
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings", "attention_bias", "qk_norm"):
        assert getattr(got, field) == getattr(want, field), field
    if qtype == "F32":  # lossless: the permutation is undone exactly, every tensor as in the HF model
        _assert_trees_equal(_params(dst), _params(src))


@pytest.mark.parametrize("family,qtype", [("gemma2", "F32"), ("phi3", "Q8_0")])
def test_gguf_new_families_match_transformers(tmp_path, family, qtype):
    """Gemma 2 (norm scales stored as 1 + w, window and soft-caps from the metadata) and Phi-3 (fused
    qkv and gate_up tensors, split at load): tensors as transformers' GGUF loader reads them, and the
    converted model's config and parameters as the HF directory's."""
    from jaxpaged.checkpoints.gguf import GGUFModel
    # llama.cpp's Gemma 2 is tied, and scales queries by head_dim ** -0.5 (but the 46-layer 27B)
    kw = dict(tie=True, query_pre_attn_scalar=16) if family == "gemma2" else {}
    src = _hf_dir(tmp_path / "hf", family, **kw)
    os.makedirs(tmp_path / "gguf")
    path = write_gguf(src, str(tmp_path / "gguf" / "m.gguf"), qtype)
    ours = dict(GGUFModel(path).tensors())
    want = _hf_gguf_state(path)
    assert set(ours) == set(want) - ({"lm_head.weight"} if family == "gemma2" else set())
    for k, v in ours.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    dst = convert(path, str(tmp_path / "dst"), dtype="float32", progress=False)
    got, ref = ModelConfig.from_dir(dst), ModelConfig.from_dir(src)
    for field in ("family", "num_layers", "head_dim", "sliding_window", "layer_types", "attn_softcap",
                  "final_softcap", "query_scale", "hidden_act", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(ref, field), field
    tol = 1e-6 if qtype == "F32" else 0.05
    a, b = _flat(_params(dst)), _flat(_params(src))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=tol * max(1, np.abs(b[k]).max()), err_msg=k)


def test_gguf_tokenizer_matches_transformers(tmp_path, llama_dir):
    from transformers import AutoTokenizer

    from jaxpaged.core.tokenizer import Tokenizer
    os.makedirs(tmp_path / "g")
    path = write_gguf(llama_dir, str(tmp_path / "g" / "m.gguf"), "Q8_0")
    dst = convert(path, str(tmp_path / "dst"), progress=False)
    with open(os.path.join(dst, "tokenizer_config.json")) as f:
        assert "chat_template" in json.load(f)
    ours = Tokenizer.from_dir(dst)
    ref = AutoTokenizer.from_pretrained(str(tmp_path / "g"), gguf_file="m.gguf")
    assert ours.backend.to_str() == ref.backend_tokenizer.to_str()
    for text in ["The quick brown fox", " Hello  world!\n", "Ünïcödé 東京 😀", "</s><s>x"]:
        assert ours.encode(text) == ref.encode(text)
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    msgs = [{"role": "user", "content": "Hi there"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.apply_chat_template(msgs) == list(want)
    assert (ours.special["bos_token"], ours.special["eos_token"], ours.special["pad_token"]) == \
        (ref.bos_token, ref.eos_token, ref.pad_token)


# -- bad input ----------------------------------------------------------------------------------
def test_src_missing(tmp_path):
    with pytest.raises(ValueError, match="nope.*no such file"):
        convert(str(tmp_path / "nope"), str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst")


def test_src_not_a_model(tmp_path):
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="empty: not a model"):
        convert(str(tmp_path / "empty"), str(tmp_path / "dst"), progress=False)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt: not a model"):
        convert(str(tmp_path / "notes.txt"), str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst") and _leftovers(tmp_path, "dst") == []


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_bad_safetensors(tmp_path, llama_dir, damage):
    src = str(tmp_path / "src")
    shutil.copytree(llama_dir, src)
    st = os.path.join(src, "model.safetensors")
    data = open(st, "rb").read()
    with open(st, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncated" else b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        convert(src, str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst") and _leftovers(tmp_path, "dst") == []


def test_unsupported_architecture(tmp_path, llama_dir):
    src = str(tmp_path / "src")
    shutil.copytree(llama_dir, src)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    with pytest.raises(ValueError, match="config.json: unsupported architecture 'GPT2LMHeadModel'"):
        convert(src, str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, llama_dir):
    d = tmp_path_factory.mktemp("gguf")
    return write_gguf(llama_dir, str(d / "m.gguf"), "Q4_1")


@pytest.mark.parametrize("cut", [10, 2000, -100])
def test_truncated_gguf(tmp_path, gguf_file, cut):
    data = open(gguf_file, "rb").read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="bad.gguf: .*(truncated|corrupt)"):
        convert(str(bad), str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst") and _leftovers(tmp_path, "dst") == []


def test_corrupt_gguf(tmp_path, gguf_file):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + open(gguf_file, "rb").read()[4:])
    with pytest.raises(ValueError, match="bad.gguf: not a readable GGUF file"):
        convert(str(bad), str(tmp_path / "dst"), progress=False)


def test_unsupported_gguf_tensor_type(tmp_path, llama_dir):
    # Q8_1 is a type the gguf package does not dequantize
    path = write_gguf(llama_dir, str(tmp_path / "q81.gguf"), "Q8_0", zeros_as={"blk.1.ffn_up.weight": "Q8_1"})
    with pytest.raises(ValueError, match="q81.gguf: tensor 'blk.1.ffn_up.weight' has GGUF type Q8_1.*not supported"):
        convert(path, str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst") and _leftovers(tmp_path, "dst") == []


def test_unknown_gguf_tensor_type_id(tmp_path, gguf_file):
    import gguf
    f = next(t.field for t in gguf.GGUFReader(gguf_file).tensors if t.name == "blk.0.attn_k.weight")
    type_offset = f.offset + sum(int(p.nbytes) for p in f.parts[:4])  # name length, name, n_dims, dims
    data = bytearray(open(gguf_file, "rb").read())
    data[type_offset:type_offset + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="bad.gguf: unsupported GGUF tensor type .*99"):
        convert(str(bad), str(tmp_path / "dst"), progress=False)


def test_unsupported_gguf_architecture(tmp_path, llama_dir):
    src = str(tmp_path / "src")
    shutil.copytree(llama_dir, src)
    path = write_gguf(src, str(tmp_path / "m.gguf"), "F32", arch="gpt2")
    with pytest.raises(ValueError, match="m.gguf: unsupported GGUF architecture 'gpt2'"):
        convert(path, str(tmp_path / "dst"), progress=False)


def test_dst_not_empty_refused_then_forced(tmp_path, llama_dir):
    dst = tmp_path / "dst"
    os.makedirs(dst)
    (dst / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="dst: exists and is not empty.*force"):
        convert(llama_dir, str(dst), progress=False)
    assert (dst / "keep.txt").read_text() == "precious"
    # a failing forced conversion leaves the old DST as it was
    with pytest.raises(ValueError):
        convert(str(tmp_path / "missing"), str(dst), force=True, progress=False)
    assert (dst / "keep.txt").read_text() == "precious"
    convert(llama_dir, str(dst), dtype="float32", force=True, progress=False)
    assert not (dst / "keep.txt").exists()
    _assert_trees_equal(_params(str(dst)), _params(llama_dir))
    assert _leftovers(tmp_path, "dst") == []
    # an existing empty directory is fine without force
    os.makedirs(tmp_path / "empty")
    convert(llama_dir, str(tmp_path / "empty"), progress=False)


def test_disk_full(tmp_path, llama_dir, monkeypatch):
    import jaxpaged.checkpoints.convert as conv

    def full(params, out):
        with open(os.path.join(out, "partial"), "wb") as f:
            f.write(b"x" * 100)
        raise RuntimeError("orbax save failed") from OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(conv, "save_orbax_params", full)
    with pytest.raises(ValueError, match="dst: disk full"):
        convert(llama_dir, str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst") and _leftovers(tmp_path, "dst") == []
