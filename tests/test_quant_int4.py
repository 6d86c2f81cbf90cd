"""int8 / int4 weights quantized at load (jaxpaged/models/qarray.py), packed once for the quantized CPU kernel
(jaxpaged/models/qpacked.py): the engine against the same model on its dequantized float weights, the
packed form's round trip and products, weight get / update, and the errors that name bad groups and
scales. One int4 engine (group 32, float32 activations, tied embeddings: the embedding packed as the head)."""
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
        assert embed.transposed and embed.bits == 8 and embed.shape == (256, 64)  # int8, one scale per entry


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
@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int8", 32), ("int4", 32), ("int4", 128), ("int4", 0)])
def test_packed_round_trip_and_product(fmt, group):
    """QArray -> QPacked -> QArray is exact; the kernel's product of layer 1 of a stack equals the float
    product of the int8-rounded activations (per 32 entries) with the dequantized matrix; K not a multiple of
    the group, row and column tails included."""
    rng = np.random.default_rng(0)
    for K, N, M in ((64, 48, 1), (100, 40, 5), (256, 128, 9)):
        w = rng.standard_normal((3, K, N)).astype(np.float32)
        qa = quantize(w, fmt, -2, "float32", group)
        qp = qpacked.pack(jax.tree.map(jnp.asarray, qa))
        back = qp.unpack()
        for a, b in ((back.q, qa.q), (back.scale, qa.scale)):
            np.testing.assert_array_equal(np.asarray(a), b)
        x = rng.standard_normal((M, K)).astype(np.float32)
        xp = np.pad(x, [(0, 0), (0, -K % 32)]).reshape(M, -1, 32)
        dx = np.abs(xp).max(-1, keepdims=True) / 127
        xq = (np.rint(xp / dx) * dx).reshape(M, -1)[:, :K]
        ref = xq @ np.asarray(dequantize(qa))[1]
        got = np.asarray(qpacked.matmul(jnp.asarray(x), qp, layer=jnp.int32(1)))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


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
