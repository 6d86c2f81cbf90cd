"""The head (lm_head, or a tied embedding read as it) kept packed for the CPU matmul kernel
(jaxpaged/models/packed.py): packed and given back exactly, its token lookup read out of the tiles exactly,
its logits on every kernel path bit for bit those of the plain head [D, V], and through an engine:
`get_weights` / `update_weights` see the plain embedding and the tokens equal XLA's dot's."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.packed import Packed, pack_layers
from jaxpaged.models.quant import dot, take_rows, unpack_layers
from pallas_kernels.matmul import cpu as cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="the CPU kernel cannot be built here")


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def test_head_packed_and_given_back_exactly():
    """A tied embedding [V, D] is packed as the head (`transposed`), an lm_head [D, V] as a matrix; shapes,
    `unpack_layers` and the token lookup (ids at both edges of a 16-row tile, repeated) give the plain values
    exactly; abstract leaves stay abstract; shapes the tiles do not fit stay plain; the transposed form is
    asked for as the head it is."""
    rng = np.random.default_rng(0)
    embed, head = _bf16(rng, (80, 64)), _bf16(rng, (64, 48))
    tied = pack_layers({"embed": embed, "layers": {}})
    untied = pack_layers({"embed": embed, "lm_head": head, "layers": {}})
    assert isinstance(tied["embed"], Packed) and tied["embed"].transposed and tied["embed"].shape == (80, 64)
    assert isinstance(untied["lm_head"], Packed) and not untied["lm_head"].transposed
    assert not isinstance(untied["embed"], Packed)  # untied: the embedding is only looked up
    np.testing.assert_array_equal(np.asarray(unpack_layers(tied)["embed"]), np.asarray(embed))
    np.testing.assert_array_equal(np.asarray(unpack_layers(untied)["lm_head"]), np.asarray(head))
    ids = jnp.asarray([0, 15, 16, 17, 79, 5, 5, 64], jnp.int32)
    got = jax.jit(take_rows)(tied["embed"], ids)
    assert got.dtype == jnp.bfloat16 and got.shape == (8, 64)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(embed[ids]))
    abstract = pack_layers({"embed": jax.ShapeDtypeStruct((80, 64), jnp.bfloat16), "layers": {}})["embed"]
    assert isinstance(abstract.tiles, jax.ShapeDtypeStruct) and abstract.shape == (80, 64)
    assert abstract.tiles.shape == (5, 2, 16, 32)
    odd = _bf16(rng, (72, 64))  # V % 16 != 0: read transposed in place
    assert not isinstance(pack_layers({"embed": odd, "layers": {}})["embed"], Packed)
    x = _bf16(rng, (3, 64))
    with pytest.raises(ValueError, match="packed embedding multiplies with transpose=True"):
        dot(x, tied["embed"], jnp.float32, transpose=False, kernel=True)


@pytest.mark.parametrize("isa", [i for i in cpu_matmul.ISAS if i != "scalar"])
def test_head_every_path_bit_for_bit(isa):
    """On path `isa` the logits off the packed head equal, bit for bit, those of the plain head [D, V] (its
    tiles interleaved as the kernel reads them), and numpy's within float32 rounding: the default model's D
    = 576 over a partial panel, for 1, 7 (the lone-row and 4-row blocks) and 64 rows; through `quant.dot`
    (the engine's call) on the build's best path."""
    if cpu_matmul.ISAS[isa] > cpu_matmul.ISAS[cpu_matmul.isa()]:
        pytest.skip(f"the {isa} path untested: the best path here is {cpu_matmul.isa()} (this CPU's flags)")
    rng = np.random.default_rng(cpu_matmul.ISAS[isa])
    embed = _bf16(rng, (400, 576))  # V = 400: 3 panels of 128 columns and a partial one of 16
    packed = pack_layers({"embed": embed, "layers": {}})["embed"]
    plain = jnp.asarray(embed.T)  # [D, V]
    for M in (1, 7, 64):
        x = _bf16(rng, (M, 576))
        got = np.asarray(cpu_matmul.cpu_matmul(x, packed.tiles, packed=True, isa=isa))
        np.testing.assert_array_equal(got, np.asarray(cpu_matmul.cpu_matmul(x, plain, isa=isa)), err_msg=f"M={M}")
        want = np.asarray(x, np.float32) @ np.asarray(plain, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(576), err_msg=f"M={M}")
        if isa == cpu_matmul.isa():
            np.testing.assert_array_equal(np.asarray(dot(x, packed, jnp.float32, transpose=True, kernel=True)), got)


def test_head_avx2_build_bit_for_bit():
    """The kernel built for AVX2 alone (-march=haswell, in a subprocess: its own build and registration):
    the packed head's logits equal the plain head's bit for bit and numpy's within rounding."""
    code = textwrap.dedent("""
        import jax.numpy as jnp, numpy as np
        from jaxpaged.models.packed import pack_layers
        from pallas_kernels.matmul import cpu as cpu_matmul
        assert cpu_matmul.isa() == "avx2"
        rng = np.random.default_rng(1)
        embed = jnp.asarray(rng.standard_normal((400, 576)), jnp.bfloat16)
        packed = pack_layers({"embed": embed, "layers": {}})["embed"]
        for M in (1, 7, 64):
            x = jnp.asarray(rng.standard_normal((M, 576)), jnp.bfloat16)
            got = np.asarray(cpu_matmul.cpu_matmul(x, packed.tiles, packed=True))
            np.testing.assert_array_equal(got, np.asarray(cpu_matmul.cpu_matmul(x, jnp.asarray(embed.T))))
            want = np.asarray(x, np.float32) @ np.asarray(embed, np.float32).T
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-2)
        print("ok")
    """)
    env = {**os.environ, "JAXPAGED_CPU_KERNEL_MARCH": "haswell", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_engine_tied_head_packed(tmp_path, engine_kwargs):
    """A tied bfloat16 model with the kernel keeps its embedding packed as the head: `get_weights` gives the
    plain embedding (the XLA engine's, exactly), `update_weights` takes a plain one and packs it again without
    recompiling, and the tokens before and after equal those of XLA's dot with the same update."""
    from jaxpaged.testing.tiny_models import make_tiny_model
    model = make_tiny_model(str(tmp_path / "m"), "llama", tie=True, seed=11)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": [5, 9, 11]}]
    out, embeds = {}, {}
    for backend in ("xla", "cpu"):
        llm = LLM(model=model, **{**engine_kwargs, "dtype": "bfloat16"}, matmul_backend=backend)
        eng = llm.engine
        assert isinstance(eng.runner.params["embed"], Packed) is (backend == "cpu")
        embeds[backend] = np.asarray(eng.get_weights()["embed"])
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        compiled = eng.runner.num_compilations
        new = (embeds[backend].astype(np.float32) * 1.25 + 0.01).astype(embeds[backend].dtype)
        eng.update_weights({"embed": jnp.asarray(new)})
        np.testing.assert_array_equal(np.asarray(eng.get_weights()["embed"]), new)
        assert isinstance(eng.runner.params["embed"], Packed) is (backend == "cpu")
        out[backend] = before, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert eng.runner.num_compilations == compiled
        del llm, eng
    np.testing.assert_array_equal(embeds["cpu"], embeds["xla"])
    assert out["cpu"] == out["xla"] and out["cpu"][0] != out["cpu"][1]
