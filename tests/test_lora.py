"""LoRA against PEFT: logits of base + adapter through the pure model function, several adapters (ranks 4
and 16, rsLoRA on and off, slot 0 = the base) packed in one batch; greedy tokens through the engine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_adapters import make_adapter, peft_last_logits

from jaxpaged import ModelConfig
from jaxpaged.checkpoints.weights import load_params
from jaxpaged.lora.request import LoRARequest
from jaxpaged.lora.slots import LoRASlots
from jaxpaged.models.llama import forward
from jaxpaged.step.attention import make_attention
from jaxpaged.step.mesh import make_mesh
from jaxpaged.testing.tiny_models import make_tiny_model

# (r, rslora) of the adapters in one batch, after a base-model request
VARIANTS = ((4, False), (4, True), (16, False), (16, True))


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """family -> (base directory, [adapter directories of VARIANTS])."""
    root = tmp_path_factory.mktemp("lora_models")
    out = {}
    for i, family in enumerate(("llama", "qwen3", "phi3")):
        base = make_tiny_model(str(root / family), family, seed=10 + i)
        out[family] = base, [make_adapter(str(root / f"{family}_a{j}"), base, family, r=r, alpha=2.0 * r,
                                          rslora=rs, seed=j) for j, (r, rs) in enumerate(VARIANTS)]
    return out


def packed_batch(prompts, slots, block_size=16):
    """One prefill step over `prompts` (each in its own blocks), token i of prompt j in LoRA slot slots[j]."""
    per_seq = max(-(-len(p) // block_size) for p in prompts)
    tables = np.array([[1 + i * per_seq + j for j in range(per_seq)] for i in range(len(prompts))], np.int32)
    ids = [t for p in prompts for t in p]
    pos = [t for p in prompts for t in range(len(p))]
    seq = [i for i, p in enumerate(prompts) for _ in p]
    slot_map = [tables[s, t // block_size] * block_size + t % block_size for s, t in zip(seq, pos)]
    qsl = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int32)
    batch = dict(input_ids=ids, positions=pos, slot_mapping=slot_map, block_tables=tables,
                 seq_lens=[len(p) for p in prompts], query_start_loc=qsl, logits_indices=qsl[1:] - 1,
                 lora_index=[slots[s] for s in seq])
    return {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in batch.items()}, 1 + len(prompts) * per_seq


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_logits_match_peft(family_models, family):
    base, adapters = family_models[family]
    cfg = ModelConfig.from_dir(base)
    lora = LoRASlots(cfg, max_loras=len(adapters), max_lora_rank=16, max_cpu_loras=None, dtype="float32",
                     mesh=make_mesh(1))
    for i, path in enumerate(adapters):
        assert lora.add(LoRARequest(f"a{i}", i + 1, path))
    slots = [0] + [lora.slot(i + 1) for i in range(len(adapters))]
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 256, size=n)] for n in (9, 17, 5, 33, 12)]
    batch, blocks = packed_batch(prompts, slots)
    params = {**jax.tree.map(jnp.asarray, load_params(base, cfg, "float32")), "lora": lora.arrays}
    pool = jnp.zeros((cfg.num_layers * blocks, 16, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    logits, _, _ = forward(params, cfg, pool, pool, batch, make_attention("reference", False))
    base_logits = peft_last_logits(base, None, prompts[0])
    for j, (p, adapter) in enumerate(zip(prompts, [None] + adapters)):
        want = peft_last_logits(base, adapter, p)
        np.testing.assert_allclose(np.asarray(logits[j]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        if adapter is not None:  # the adapter matters: a wrong slot or a lost delta would show
            assert np.abs(want - peft_last_logits(base, None, p)).max() > 0.05 * np.abs(want).max()
    np.testing.assert_allclose(np.asarray(logits[0]), base_logits, rtol=1e-4, atol=1e-4 * np.abs(base_logits).max())
