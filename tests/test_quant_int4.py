"""int8 / int4 weights quantized at load (jaxpaged/models/qarray.py), packed once for the quantized CPU kernel
(jaxpaged/models/qpacked.py): the engine against the same model on its dequantized float weights, the
packed form's round trip and products, weight get / update, and the errors that name bad groups and
scales; int4's per-group minimum (the default: Q4_1 values come back exactly). One int4 engine (group 32
with a minimum, float32 activations, tied embeddings: the embedding packed as the head)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant import _all_position_logits

from jaxpaged import LLM, EngineConfig, SamplingParams
from jaxpaged.config import ModelConfig
from jaxpaged.models import qpacked
from jaxpaged.models.qarray import QArray, dequantize, quantize
from jaxpaged.models.quant import ragged_dot
from jaxpaged.testing.kernel_activations import int8_rounded
from jaxpaged.testing.tiny_models import make_tiny_model
from pallas_kernels.matmul import cpu_quant

KERNEL = cpu_quant.available()
# |logprob| difference allowed between the engine and float32 on its dequantized weights: the kernel rounds
# activations to int8 per 32 entries (relative error ~0.5% a product), the only difference from the reference
TOL = 0.05
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
PROMPTS = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(2).integers(3, 250, 37)]},
           {"prompt_token_ids": [5, 9, 11]}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, compile_cache):
    path = make_tiny_model(str(tmp_path_factory.mktemp("q4") / "m"), "llama", seed=5, initializer_range=0.1,
                           tie=True)
    llm = LLM(model=path, dtype="float32", quantization="int4", max_num_seqs=4, max_num_batched_tokens=16,
              max_model_len=128, compilation_cache_dir=compile_cache, show_progress=False)
    yield path, llm
    del llm


def _check_against_float(llm, path):
    """Greedy outputs (chunked prefill of 37 tokens in chunks of 16, then decode) against the pure step on the
    engine's own weights dequantized to float32, teacher-forced on the engine's tokens."""
    cfg = ModelConfig.from_dir(path)
    params = jax.tree.map(jnp.asarray, llm.engine.get_weights())
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        got = o.outputs[0].token_ids
        ids = p["prompt_token_ids"] + list(got)
        logp = jax.nn.log_softmax(_all_position_logits(params, cfg, ids)[len(p["prompt_token_ids"]) - 1:-1], -1)
        ref = np.asarray(logp)
        for i, (t, lp) in enumerate(zip(got, o.outputs[0].logprobs)):
            engine_lp = float(getattr(lp[t], "logprob", lp[t]))
            assert abs(engine_lp - ref[i, t]) <= TOL, (i, engine_lp, ref[i, t])
            top2 = np.sort(ref[i])[-2:]
            assert t == ref[i].argmax() or top2[1] - top2[0] <= 2 * TOL, (i, t, ref[i].argmax())
    return outs


def test_engine_packs_and_says_which_product(setup):
    _, llm = setup
    layers = llm.engine.runner.params["layers"]
    assert isinstance(layers["w_up"], qpacked.QPacked if KERNEL else QArray)
    embed = llm.engine.runner.params["embed"]  # tied: the lookup and, packed as the head, the logits
    assert isinstance(embed, qpacked.QPacked if KERNEL else QArray)
    backend = llm.engine.stats()["matmul_backend"]
    assert backend.startswith("cpu_quant") is KERNEL, backend
    if KERNEL:
        assert layers["w_up"].bits == 4 and layers["w_up"].group == 32
        assert layers["w_up"].has_min and layers["w_up"].zero == 0  # int4's default: a per-group minimum
        assert embed.transposed and embed.bits == 8 and embed.shape == (256, 64)  # int8
        assert embed.group == 32 and not embed.has_min  # symmetric, in groups of 32 along the hidden axis


def test_tokens_match_the_dequantized_float_model(setup):
    path, llm = setup
    _check_against_float(llm, path)


def test_weights_round_trip_and_update(setup):
    """get_weights gives plain float matrices; giving them back changes nothing; an update of one layer by
    its HF name is quantized as at load, packed again, and seen by the next get_weights (no recompiling)."""
    path, llm = setup
    eng = llm.engine
    before = eng.runner.num_compilations
    w = eng.get_weights()
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(w))
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    eng.update_weights(w)
    np.testing.assert_array_equal(np.asarray(eng.get_weights()["layers"]["wq"]), np.asarray(w["layers"]["wq"]))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == first
    new = np.asarray(w["layers"]["w_up"])[1] * -1.5
    eng.update_weights([("model.layers.1.mlp.up_proj.weight", new.T.copy())])
    up = np.asarray(eng.get_weights()["layers"]["w_up"])
    np.testing.assert_array_equal(up[0], np.asarray(w["layers"]["w_up"])[0])
    assert np.abs(up[1] - new).max() <= np.abs(new).max() / 7  # one int4 step of the largest group at most
    assert isinstance(eng.runner.params["layers"]["w_up"], qpacked.QPacked if KERNEL else QArray)
    assert eng.runner.num_compilations == before
    _check_against_float(llm, path)


@pytest.mark.skipif(not KERNEL, reason="the quantized CPU kernel cannot be built here")
@pytest.mark.parametrize("fmt,group,symmetric", [("int8", 0, True), ("int8", 32, True), ("int4", 32, True),
                                                 ("int4", 128, True), ("int4", 0, True), ("int4", 32, False),
                                                 ("int4", 64, False), ("int4", 0, False)])
def test_packed_round_trip_and_product(fmt, group, symmetric):
    """QArray -> QPacked -> QArray is exact; the kernel's product of layer 1 of a stack equals the float
    product of the activations rounded (per block of `act_block` entries: 32, 128 for one scale a column) to
    the packed matrix's `act_bits` (int16 codes for
    int8 weights, int8 for int4, or as chosen) with the dequantized matrix (with a minimum too); K not a
    multiple of the group, row and column tails included."""
    rng = np.random.default_rng(0)
    for K, N, M in ((64, 48, 1), (100, 40, 5), (256, 128, 9)):
        w = rng.standard_normal((3, K, N)).astype(np.float32)
        qa = quantize(w, fmt, -2, "float32", group, symmetric=symmetric)
        choice = (None, 8, 16)[K % 3]  # quantization_activation_bits: the default, int8, int16
        qp = qpacked.pack(jax.tree.map(jnp.asarray, qa), act_bits=choice)
        assert qp.act_bits == (choice or {8: 16, 4: 8}[qa.bits])
        back = qp.unpack()
        assert (back.m is None) == symmetric
        for a, b in ((back.q, qa.q), (back.scale, qa.scale)) + (() if symmetric else ((back.m, qa.m),)):
            np.testing.assert_array_equal(np.asarray(a), b)
        x = rng.standard_normal((M, K)).astype(np.float32)
        ref = (int8_rounded(x, qp.layout.act_block, act_bits=qp.act_bits, outlier=qp.act_outlier)
               @ np.asarray(dequantize(qa))[1])
        got = np.asarray(qpacked.matmul(jnp.asarray(x), qp, layer=jnp.int32(1)))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("fmt,group,symmetric", [("int8", 32, True), ("int4", 32, False), ("int4", 64, True),
                                                 ("int8", 0, True)])
def test_grouped_scales_are_float16_values(fmt, group, symmetric):
    """Grouped quantization picks float16 values as scales and minima and rounds the codes with them: each
    value within half its scale, codes in range, packed in two bytes a scale and exactly the QArray's. Per
    column (group 0: the scale's bytes are negligible) keeps float32 max|w| / 127. Weights float16 cannot
    scale to its precision (huge, or all tiny) keep float32 scales, and pack in four bytes, exactly too."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.02, (2, 100, 48)).astype(np.float32)
    for factor, half in ((1.0, bool(group)), (1e9, False), (1e-7, False)):
        qa = quantize(w * np.float32(factor), fmt, -2, "float32", group, symmetric=symmetric)
        assert cpu_quant.half_exact(qa.scale, qa.m) == half, factor
        step = np.take(qa.scale, np.arange(100) // (group or 100), axis=1)
        assert np.all(np.abs(dequantize(qa) - w * np.float32(factor)) <= step / 2 * (1 + 1e-5)), factor
        assert np.abs(qa.q).max() <= (127 if fmt == "int8" else 15)
        if KERNEL:
            qp = qpacked.pack(jax.tree.map(jnp.asarray, qa))
            assert qp.scale_bytes == (2 if half else 4)
            for x, y in ((qp.unpack().scale, qa.scale), (qp.unpack().m, qa.m)):
                assert (x is None) == (y is None) and (x is None or np.array_equal(np.asarray(x), y))
    if not group:
        np.testing.assert_array_equal(qa.scale, np.abs(w * np.float32(1e-7)).max(1, keepdims=True) / 127)


@pytest.mark.skipif(not KERNEL, reason="the quantized CPU kernel cannot be built here")
def test_scale_bytes_kept_or_refused():
    """`pack` refuses float16 storage for scales that are not float16 values (naming the layout's field);
    `pack_quantized(like=)` keeps the layout of the parameters replaced, so a weight update keeps the
    step's shapes."""
    rng = np.random.default_rng(4)
    qa = jax.tree.map(jnp.asarray, quantize(rng.normal(0, 0.02, (64, 32)).astype(np.float32), "int4", -2,
                                            group=32, symmetric=False))
    odd = dataclasses.replace(qa, scale=qa.scale * np.float32(1 + 2 ** -15))
    with pytest.raises(ValueError, match="scale_bytes=2"):
        qpacked.pack(odd, scale_bytes=2)
    assert qpacked.pack(odd).scale_bytes == 4 and qpacked.pack(qa).scale_bytes == 2
    params = {"embed": np.zeros((4, 4), np.float32), "layers": {"w_up": qa}}
    before = qpacked.pack_quantized({**params, "layers": {"w_up": odd}})
    again = qpacked.pack_quantized(params, like=before)
    assert before["layers"]["w_up"].scale_bytes == again["layers"]["w_up"].scale_bytes == 4
    assert np.array_equal(np.asarray(again["layers"]["w_up"].unpack().scale), np.asarray(qa.scale))


def test_grouped_products_and_experts_match_dequantized():
    """The reference path (XLA: GPU, TPU, several devices) of grouped int4 with a minimum: dot and the MoE
    experts' ragged_dot equal the products with the dequantized matrices."""
    from jaxpaged.models.quant import dot
    rng = np.random.default_rng(1)
    u = rng.integers(0, 16, (2, 48, 24)).astype(np.uint8)
    s = rng.uniform(0.01, 0.1, (2, 3, 24)).astype(np.float32)
    m = rng.uniform(-0.5, 0, (2, 3, 24)).astype(np.float32)
    qa = jax.tree.map(jnp.asarray, QArray.from_codes(u, s, m, zero=0, group=16, bits=4))
    deq = np.asarray(dequantize(qa))
    np.testing.assert_allclose(deq, s.repeat(16, 1) * u + m.repeat(16, 1), rtol=1e-6)
    x = rng.standard_normal((5, 48)).astype(np.float32)
    one = jax.tree.map(lambda a: a[1], qa)
    np.testing.assert_allclose(np.asarray(dot(jnp.asarray(x), one)), x @ deq[1], rtol=1e-5, atol=1e-5)
    sizes = jnp.array([2, 3], jnp.int32)
    got = ragged_dot(jnp.asarray(x), qa, sizes, jnp.array([0, 0, 1, 1, 1]))
    np.testing.assert_allclose(np.asarray(got), np.concatenate([x[:2] @ deq[0], x[2:] @ deq[1]]), rtol=1e-5,
                               atol=1e-5)


def test_bad_groups_and_scales_are_named():
    for kw, match in ((dict(quantization="int4", quantization_group_size=48), "quantization_group_size"),
                      (dict(quantization_group_size=32), "quantization_group_size=32 needs quantization"),
                      (dict(quantization="fp8", quantization_group_size=32), "fp8 takes one scale")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kw)
    u = np.full((32, 16), 3, np.uint8)
    s = np.ones((1, 16), np.float32)
    with pytest.raises(ValueError, match="s holds 1 NaN / inf"):
        QArray.from_codes(u, np.where(np.arange(16) == 5, np.nan, s).astype(np.float32), zero=8)
    with pytest.raises(ValueError, match="m holds 1 NaN / inf"):
        QArray.from_codes(u, s, np.where(np.arange(16) == 2, np.inf, s).astype(np.float32))
    with pytest.raises(ValueError, match="group must be one of"):
        QArray.from_codes(u, s, group=24)
    with pytest.raises(ValueError, match="s must be float32"):
        QArray.from_codes(u, np.ones((2, 16), np.float32), zero=8)
    with pytest.raises(ValueError, match="codes >= 2"):
        QArray.from_codes(u + 20, s, zero=8)
    with pytest.raises(ValueError, match="'model.layers.0.mlp' holds NaN / inf"):
        quantize(np.array([[1.0, np.inf]] * 32, np.float32), "int4", -2, group=32, name="model.layers.0.mlp")


def q4_1_values(rng, shape, axis, group=32):
    """Q4_1-style values [shape]: per block of `group` along `axis`, d * q + m with codes q in 0..15 (both
    ends in every block of two or more entries, as llama.cpp's quantizer leaves them) and d, m float16
    values (as GGUF stores them) -> (w float32, q uint8, m float32 per block [.., blocks, ..])."""
    w_last = np.moveaxis(np.empty(shape), axis, -1)
    n, blocks = w_last.shape[-1], -(-w_last.shape[-1] // group)
    q = rng.integers(0, 16, w_last.shape)
    q[..., 0::group], q[..., 1::group] = 0, 15
    if n % group == 1:  # a last block of one entry: its value is its minimum
        q[..., -1] = 0
    d = rng.uniform(1e-3, 2e-2, (*w_last.shape[:-1], blocks)).astype(np.float16).astype(np.float32)
    m = rng.normal(0, 0.05, d.shape).astype(np.float16).astype(np.float32)
    idx = np.arange(n) // group
    w = d[..., idx] * q + m[..., idx]
    return (np.moveaxis(w.astype(np.float32), -1, axis), np.moveaxis(q.astype(np.uint8), -1, axis),
            np.moveaxis(m, -1, axis))


@pytest.mark.parametrize("shape,axis", [((64, 16), -2), ((100, 24), -2), ((3, 33, 40), -2), ((2, 3, 130, 8), -2),
                                        ((50, 96), -1), ((7, 45), -1)])
def test_minimum_reproduces_q4_1_blocks(shape, axis):
    """int4 with a minimum (symmetric=False) in groups of 32 aligned with Q4_1's blocks gives back their
    codes and minima exactly and their values to float32 rounding (K not a multiple of the group, stacks,
    either reduced axis); any data comes back within half a step of its group, codes 0..15."""
    rng = np.random.default_rng(sum(shape))
    w, q, m = q4_1_values(rng, shape, axis)
    qa = quantize(w, "int4", axis, group=32, symmetric=False)
    assert qa.zero == 0 and qa.bits == 4 and qa.m.shape == qa.scale.shape and qa.m.dtype == np.float32
    np.testing.assert_array_equal(qa.q, q)
    np.testing.assert_array_equal(qa.m, m)
    np.testing.assert_allclose(dequantize(qa), w, rtol=0, atol=2e-7 * np.abs(w).max())
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 3, shape[-1])
    qa = quantize(x, "int4", axis, group=32, symmetric=False)
    assert qa.q.min() >= 0 and qa.q.max() <= 15
    step = np.take(qa.scale, np.arange(shape[axis]) // 32, axis=axis)
    assert np.all(np.abs(dequantize(qa) - x) <= step / 2 * (1 + 1e-5) + 1e-7)
    flat = quantize(np.full(shape, 0.25, np.float32), "int4", axis, group=32, symmetric=False)  # one value
    assert not flat.q.any() and np.array_equal(dequantize(flat), np.full(shape, 0.25, np.float32))


def test_bad_symmetry_is_named():
    """quantization_symmetric: a bool, False (a minimum) for int4 and int8, with a quantization; the bench's
    weights names refuse what the engine would; a NaN / inf is refused by the tensor's name."""
    from jaxpaged.bench.quality import weights_config
    for kw, match in ((dict(quantization="fp8", quantization_symmetric=False), "takes quantization 'int4'"),
                      (dict(quantization="int4", quantization_symmetric="no"), "must be True or False"),
                      (dict(quantization_symmetric=True), "quantization_symmetric=True needs quantization")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kw)
    assert EngineConfig(quantization="int4", quantization_symmetric=True).quantization_symmetric
    with pytest.raises(ValueError, match="takes quantization 'int4'"):
        quantize(np.ones((32, 4), np.float32), "fp8", -2, symmetric=False)
    with pytest.raises(ValueError, match="'model.layers.1.attn' holds NaN / inf"):
        quantize(np.array([[0.5, np.nan]] * 40, np.float32), "int4", -2, group=32, symmetric=False,
                 name="model.layers.1.attn")
    assert weights_config("int4:g64:sym:xla") == dict(dtype="float32", quantization="int4", quantization_group_size=64,
                                                      quantization_symmetric=True, matmul_backend="xla")
    for name, match in (("fp8:asym", "takes quantization 'int4'"), ("int4:g48", "quantization_group_size"),
                        ("float32:xla", "take a quantized name"), ("int4:fast", "unknown option 'fast'"),
                        ("int3", "the name must be one of")):
        with pytest.raises(ValueError, match=match):
            weights_config(name)


def test_int4_load_and_convert_keep_the_matrices(tmp_path):
    """A float checkpoint loaded as int4 (a minimum: its codes, scales and minima all stored) and
    `jaxpaged convert --quantization int4` (written as codes, scales and minima) give matrices within half a step of
    the source's (a minimum lost on the way would shift whole groups)."""
    from test_convert import _hf_dir

    from jaxpaged.checkpoints.convert import convert
    from jaxpaged.checkpoints.weights import load_params
    src = _hf_dir(tmp_path / "hf", initializer_range=0.2)
    dst = convert(src, str(tmp_path / "i4"), dtype="float32", progress=False, quantization="int4")
    cfg = ModelConfig.from_dir(dst)
    want, back = load_params(src, cfg, "float32"), load_params(dst, cfg, "float32")  # back: widened
    loaded = load_params(src, cfg, "float32", quantization="int4")
    for name in ("wq", "w_up", "w_down"):
        w, qa = want["layers"][name], loaded["layers"][name]  # [L, K, N]: groups of 32 along K
        step = np.take(qa.scale, np.arange(w.shape[1]) // 32, axis=1)
        assert qa.m is not None and np.all(np.abs(dequantize(qa) - w) <= step / 2 * (1 + 1e-5) + 1e-7), name
        amax = np.abs(np.pad(w, [(0, 0), (0, -w.shape[1] % 32), (0, 0)])).reshape(
            w.shape[0], -1, 32, w.shape[2]).max(2).repeat(32, 1)[:, :w.shape[1]]
        assert np.all(np.abs(back["layers"][name] - w) <= amax / 14 * (1 + 1e-5) + 1e-7), name


@pytest.mark.skipif(not KERNEL, reason="the quantized CPU kernel cannot be built here")
def test_fused_products_keep_the_tokens(setup, monkeypatch):
    """Greedy tokens and logprobs with a layer's q, k, v (and gate, up) in one quantized kernel call equal
    those with one call a matrix (tests/test_matmul_quant_fused_cpu.py `one_call_each`), bit for bit; the
    step makes 3 kernel calls fewer a layer. The steps compile again under each form."""
    from test_matmul_quant_fused_cpu import one_call_each
    llm, runner = setup[1], setup[1].engine.runner

    def run():  # -> the outputs, the kernel calls in a step
        runner._compiled.clear()
        outs = [(o.outputs[0].token_ids, [{t: float(getattr(v, "logprob", v)) for t, v in lp.items()}
                                          for lp in o.outputs[0].logprobs])
                for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return outs, runner.compiled_step(runner.variants()[0]).as_text().count(cpu_quant.TARGET + '"')
    fused = run()
    monkeypatch.setattr(cpu_quant, "cpu_quant_matmuls", one_call_each)
    each = run()
    monkeypatch.undo()
    runner._compiled.clear()  # the engine's own steps again, compiled at their next use
    assert fused[0] == each[0] and each[1] - fused[1] == 3, (fused[1], each[1])
