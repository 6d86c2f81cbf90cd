"""The per-layer weight layout the step reads (models/layer_stack.py): same numbers as the stacked
layout, conversions that round-trip, and a compiled step that copies no layer matrix."""
import re

import jax
import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.config import ModelConfig
from jaxpaged.checkpoints.weights import load_params
from jaxpaged.models.layer_stack import is_per_layer, replace, stacked, stacked_shapes, unstack
from jaxpaged.models.llama import forward
from jaxpaged.step.attention import make_attention
from models import make_tiny_model


def _batch(T=5, S=2, B=4, bs=4):
    """Two requests: 3 prefill tokens of slot 0 and 2 of slot 1, blocks 1.. in order."""
    tables = np.zeros((S, B), np.int32)
    tables[0, :1], tables[1, :1] = [1], [2]
    pos = np.array([0, 1, 2, 0, 1], np.int32)
    blocks = np.array([1, 1, 1, 2, 2], np.int32)
    return dict(input_ids=np.array([5, 9, 17, 3, 40], np.int32), positions=pos, slot_mapping=blocks * bs + pos,
                block_tables=tables, seq_lens=np.array([3, 2], np.int32),
                query_start_loc=np.array([0, 3, 5], np.int32), logits_indices=np.array([2, 4], np.int32))


@pytest.mark.parametrize("family,layers", [("llama", 3), ("gemma3", 4)])
def test_per_layer_equals_stacked(tmp_path, family, layers):
    """forward() on the per-layer layout (the layers unrolled over their own arrays) gives the stacked layout's
    logits (lax.scan over slices), for period 1 and for Gemma 3's period 3 with a tail layer."""
    path = make_tiny_model(str(tmp_path / family), family, num_layers=layers, seed=3)
    cfg = ModelConfig.from_dir(path)
    params = jax.tree.map(np.asarray, load_params(path, cfg, "float32"))
    pool = np.zeros((cfg.num_layers * 4, 4, cfg.num_kv_heads, cfg.head_dim), np.float32)
    fn = jax.jit(lambda p, b: forward(p, cfg, pool, pool, b, make_attention("reference", False))[0])
    want = fn(params, _batch())
    got = fn(unstack(params, cfg.num_layers), _batch())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_conversions_round_trip(tmp_path, engine_kwargs):
    """stacked / stacked_shapes / replace on the engine's per-layer params."""
    path = make_tiny_model(str(tmp_path / "m"), "llama", num_layers=3, seed=1)
    llm = LLM(model=path, quantization="int8", warmup=False, **engine_kwargs)
    params = llm.engine.runner.params
    assert is_per_layer(params) and len(params["layers"]) == 3
    full = stacked(params)
    shapes = stacked_shapes(params)
    for a, s in zip(jax.tree.leaves(full), jax.tree.leaves(shapes)):
        assert a.shape == s.shape and a.dtype == s.dtype and a.sharding.is_equivalent_to(s.sharding, a.ndim)
    q = np.asarray(full["layers"]["wq"].q)
    np.testing.assert_array_equal(q[1], np.asarray(params["layers"][1]["wq"].q))
    path_q = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey("wq"), jax.tree_util.GetAttrKey("q"))
    new = replace(params, {path_q: full["layers"]["wq"].q[::-1]})
    np.testing.assert_array_equal(np.asarray(new["layers"][0]["wq"].q), q[2])
    np.testing.assert_array_equal(np.asarray(new["layers"][0]["wk"].q), np.asarray(params["layers"][0]["wk"].q))
    assert new["embed"].q is params["embed"].q  # other leaves as they are


def test_step_copies_no_layer_matrix(tmp_path, engine_kwargs):
    """In the compiled step (float32), no instruction produces a copy of a layer's matrix: each product
    reads it where it lies (the scan over stacked weights copied every slice out)."""
    path = make_tiny_model(str(tmp_path / "m"), "llama", num_layers=3, seed=2, hidden_size=48)
    llm = LLM(model=path, warmup=False, **engine_kwargs)
    r = llm.engine.runner
    matrices = {",".join(map(str, a.shape)) for a in jax.tree.leaves(r.params["layers"][0]) if a.ndim == 2}
    for key in ((1, False), (r.buckets[-1], False)):
        text = r.compiled_step(key).as_text()
        made = re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} (fusion|copy|dynamic-slice|slice)\(", text)
        assert not [m for m in made if m[0] in matrices], made
