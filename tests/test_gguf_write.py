"""GGUF files the tests and benches write: Q4_K blocks from the format (jaxpaged/testing/gguf_kquant.py) read back
by gguf.quants.dequantize; a Q4_K file run packed with greedy tokens equal to HF's on what it holds; and
`jaxpaged convert` of a GGUF keeping the file's codes, scales and minimums, loading packed with the same tokens."""
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from oracle import hf_greedy
from safetensors.numpy import save_file

from jaxpaged import LLM, ModelConfig, SamplingParams
from jaxpaged.models.qarray import QArray
from jaxpaged.testing.gguf_kquant import quantize_q4_k
from jaxpaged.testing.kernel_activations import int8_rounded

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
VOCAB = 300


def _q4_k_rows(n, k, seed):
    """Rows whose sub-blocks of 32 differ in range and sign (a swapped scale or minimum shows), a zero block,
    and an all-positive and an all-negative sub-block."""
    rng = np.random.default_rng(seed)
    spread = rng.uniform(0.01, 1.0, (n, k // 32, 1))
    a = (rng.normal(0, 1, (n, k // 32, 32)) * spread + rng.normal(0, 0.5, (n, k // 32, 1))).reshape(n, k)
    a[0, :256] = 0
    a[-1, 256 - 32:256] = np.abs(a[-1, 256 - 32:256]) + 0.3
    a[-1, :32] = -np.abs(a[-1, :32]) - 0.3
    return a.astype(np.float32)


@pytest.mark.parametrize("n,k", [(2, 256), (3, 512), (16, 1024), (40, 768)])
def test_q4_k_blocks_read_back_by_gguf(n, k):
    """gguf.quants.dequantize reads the blocks back within the format's error: each value within half of its
    sub-block's step (d * sc) plus the 6-bit rounding of the step (over 15 codes) and of the minimum."""
    a = _q4_k_rows(n, k, seed=n * k)
    data = quantize_q4_k(a)
    assert data.shape == (n, k // 256 * 144) and data.dtype == np.uint8
    back = dequantize(data, GGMLQuantizationType.Q4_K).reshape(n, k)
    x = a.reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0)
    step = (x.max(axis=2) - lo) / 15
    d, dmin = step.max(axis=1, keepdims=True) / 63, -lo.min(axis=1, keepdims=True) / 63  # [blocks, 1]
    bound = step / 2 + 15 * d / 2 + dmin / 2 + 1e-3 * (d + dmin)                        # [blocks, 8]
    err = np.abs(back - a).reshape(-1, 8, 32).max(axis=2)
    assert np.all(err <= bound), float((err / bound).max())
    np.testing.assert_array_equal(back[0, :256], 0)
    assert np.mean(np.abs(back - a)) < 0.3 * np.mean(step)  # most values near their code, not at the bound


def test_q4_k_bad_input_named():
    with pytest.raises(ValueError, match=r"Q4_K: rows of shape \(2, 100\) are not whole blocks of 256"):
        quantize_q4_k(np.zeros((2, 100), np.float32))
    bad = np.zeros((1, 256), np.float32)
    bad[0, 7] = np.nan
    with pytest.raises(ValueError, match="Q4_K: the tensor holds NaN / inf"):
        quantize_q4_k(bad)


@pytest.fixture(scope="module")
def q4k(tmp_path_factory):
    """(a Q4_K GGUF of a tiny llama with rows of 256, the HF directory of the values it holds)."""
    from jaxpaged.testing.gguf_files import write_gguf
    from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model
    root = tmp_path_factory.mktemp("q4k")
    hf = make_tiny_model(str(root / "hf"), "llama", vocab_size=VOCAB, hidden_size=256, num_layers=2, tie=True,
                         seed=4, initializer_range=0.05)
    add_tiny_tokenizer(hf, VOCAB)
    values = {}
    path = write_gguf(hf, str(root / "m.Q4_K.gguf"), "Q4_K", values=values)
    save_file(values, os.path.join(hf, "model.safetensors"))
    return path, hf


def _prompts():
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(3, VOCAB, size=n)] for n in (4, 11)]


def _greedy(model, engine_kwargs, **over):
    llm = LLM(model=model, **{**engine_kwargs, "block_size": 4, "max_num_batched_tokens": 16, **over})
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_q4_k_file_greedy_equals_hf(q4k, engine_kwargs):
    """Every matrix of the file is Q4_K (the norms F32); kept quantized on XLA's product (the exact reference:
    the quantized kernel rounds activations), the greedy tokens are HF's on the values the file holds."""
    import gguf
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(q4k[0]).tensors}
    assert {n for n, t in types.items() if t == "Q4_K"} == {n for n in types if not n.endswith("norm.weight")}
    tokens, llm = _greedy(q4k[0], engine_kwargs, matmul_backend="xla")
    assert llm.stats()["matmul_backend"] == "xla"
    assert isinstance(llm.engine.runner.params["layers"]["w_up"], QArray)
    assert tokens == [hf_greedy(q4k[1], p, GREEDY.max_tokens) for p in _prompts()]


@pytest.fixture(scope="module")
def kernel_run(q4k, engine_kwargs):
    """(greedy tokens, the engine) on the file with no quantization asked: the file's codes decide, and on one
    CPU they run packed on the quantized kernel."""
    return _greedy(q4k[0], engine_kwargs)


def test_kept_codes_run_packed_on_the_quantized_kernel(q4k, kernel_run):
    """The runner packs the file's codes (4-bit, groups of 32, minimums, in the two-level scale form; the tied
    embedding as the head) for the quantized CPU kernel where it builds, and the tokens stay within the
    kernel's activation rounding of the float model on the same weights (tests/test_quant_int4.py's check)."""
    import jax.numpy as jnp
    from test_quant_int4 import _check_against_float

    from jaxpaged.checkpoints.gguf_load import gguf_model_dir
    from jaxpaged.models.qarray import dequantize
    from jaxpaged.models.qpacked import QPacked
    from jaxpaged.models.qpacked import matmul as qpacked_matmul
    from pallas_kernels.matmul import cpu_quant
    _, llm = kernel_run
    if not cpu_quant.available():
        pytest.skip("the quantized CPU kernel does not build here")
    assert llm.stats()["matmul_backend"].startswith("cpu_quant")
    up, embed = llm.engine.runner.params["layers"]["w_up"], llm.engine.runner.params["embed"]
    assert isinstance(up, QPacked) and (up.bits, up.group, up.has_min) == (4, 32, True)
    assert isinstance(embed, QPacked) and embed.transposed and embed.has_min
    assert up.superblock == embed.superblock == 256  # the two-level scales: the file's d per 256, int8 sub-scales
    # the product of layer 1's packed w_up: the float product of the activations rounded (per 32, to its act_bits)
    # with the file's dequantized matrix (its codes, scales and minimums read back by unpack)
    x = np.random.default_rng(6).standard_normal((5, up.K)).astype(np.float32)
    want = int8_rounded(x, act_bits=up.act_bits, outlier=up.act_outlier) @ np.asarray(dequantize(up.unpack()))[1]
    got = np.asarray(qpacked_matmul(jnp.asarray(x), up, layer=jnp.int32(1)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    _check_against_float(llm, gguf_model_dir(q4k[0]))


@pytest.fixture(scope="module")
def converted(q4k, tmp_path_factory):
    from jaxpaged.cli import main
    d = tmp_path_factory.mktemp("conv")
    packed, plain = str(d / "packed"), str(d / "plain")
    assert main(["convert", q4k[0], packed, "--dtype", "float32"]) == 0
    assert main(["convert", q4k[0], plain, "--dtype", "float32", "--no-keep-quantized"]) == 0
    return packed, plain


def test_convert_keeps_the_gguf_packed(q4k, converted, kernel_run, engine_kwargs):
    """`jaxpaged convert x.gguf` saves the file's quantized matrices as they load from it (codes, scales,
    minimums, group, bits, zero); the engine loads the directory packed and its greedy tokens equal those of
    the GGUF loaded directly. --no-keep-quantized writes float matrices: the dequantized ones."""
    import jax

    from jaxpaged.checkpoints.gguf_load import gguf_model_dir, load_gguf_params
    from jaxpaged.checkpoints.weights import load_params
    from jaxpaged.models.qarray import dequantize
    packed, plain = converted
    cfg = ModelConfig.from_dir(gguf_model_dir(q4k[0]))
    direct = load_gguf_params(q4k[0], cfg, "float32")
    back = load_params(packed, cfg, "float32", keep_quantized=True)
    flat = [jax.tree_util.tree_flatten_with_path(t, is_leaf=lambda x: isinstance(x, QArray))[0] for t in (direct, back)]
    assert [p for p, _ in flat[0]] == [p for p, _ in flat[1]]
    kept = 0
    for (path, a), (_, b) in zip(*flat):
        assert isinstance(a, QArray) == isinstance(b, QArray), path
        if isinstance(a, QArray):
            kept += 1
            assert (b.group, b.bits, b.zero, b.dtype, b.m is None) == (a.group, a.bits, a.zero, a.dtype, a.m is None)
            for x, y in ((a.q, b.q), (a.scale, b.scale), (a.m, b.m)):
                if x is not None:
                    np.testing.assert_array_equal(x, y, err_msg=str(path))
        else:
            np.testing.assert_array_equal(a, b)
    assert kept == 8 and direct["layers"]["w_up"].m is not None  # wq wk wv wo w_gate w_up w_down, the embedding
    widened = load_params(plain, cfg, "float32", keep_quantized=True)
    assert not any(isinstance(x, QArray) for x in jax.tree.leaves(widened, is_leaf=lambda x: isinstance(x, QArray)))
    np.testing.assert_array_equal(widened["layers"]["w_down"], dequantize(direct["layers"]["w_down"]))
    np.testing.assert_array_equal(load_params(packed, cfg, "float32")["embed"], dequantize(direct["embed"]))
    tokens, llm = _greedy(packed, engine_kwargs)
    assert tokens == kernel_run[0] and llm.stats()["matmul_backend"] == kernel_run[1].stats()["matmul_backend"]


def test_saved_form_checked_at_load(converted, tmp_path):
    """A converted directory whose saved quantized matrix has a NaN scale or codes outside its form is
    refused at load, by the leaf and the operand."""
    from jaxpaged.checkpoints.weights import load_params, save_orbax_params
    packed, _ = converted
    cfg = ModelConfig.from_dir(packed)
    params = load_params(packed, cfg, "float32", keep_quantized=True)
    wq = params["layers"]["wq"]
    scale = np.array(wq.scale)
    scale[1, 0, 3] = np.nan
    params["layers"]["wq"] = QArray(wq.q, scale, wq.dtype, wq.m, wq.group, wq.bits, wq.zero)
    save_orbax_params(params, str(tmp_path / "nan"))
    with pytest.raises(ValueError, match=r"layers/wq: scale holds 1 NaN / inf value\(s\) \(first at \[1, 0, 3\]\)"):
        load_params(str(tmp_path / "nan"), cfg, "float32", keep_quantized=True)
    q = np.array(wq.q)
    q[0, 5, 1] = 16  # a 4-bit code of 16 (zero 0)
    params["layers"]["wq"] = QArray(q, wq.scale, wq.dtype, wq.m, wq.group, wq.bits, wq.zero)
    save_orbax_params(params, str(tmp_path / "code"))
    with pytest.raises(ValueError, match=r"layers/wq: q holds codes outside 0..15"):
        load_params(str(tmp_path / "code"), cfg, "float32", keep_quantized=True)
