"""LoRA through the engine: a batch mixing the base and three adapters gives each request PEFT's greedy
tokens, through preemption, chunked prefill and prefix hits, with adapters loaded, evicted (device slots
and host cache) and replaced while requests run, and no step ever recompiled."""
import shutil

import numpy as np
import pytest
from lora_adapters import make_adapter, peft_greedy
from safetensors.numpy import load_file, save_file

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.testing.tiny_models import make_tiny_model

N_NEW = 6


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory, compile_cache):
    family = request.param
    root = tmp_path_factory.mktemp(f"lora_engine_{family}")
    base = make_tiny_model(str(root / "base"), family, seed=20)
    adapters = [make_adapter(str(root / f"a{j}"), base, family, r=r, alpha=2.0 * r, rslora=rs, seed=30 + j)
                for j, (r, rs) in enumerate(((4, False), (16, True), (8, False), (16, False)))]
    llm = LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16, dtype="float32",
              block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=16,
              compilation_cache_dir=compile_cache, show_progress=False)
    return base, adapters, llm


def _workload():
    rng = np.random.default_rng(7)
    ids = lambda n: [int(t) for t in rng.integers(3, 256, size=n)]  # noqa: E731
    shared = ids(20)  # 5 full blocks: the same prompt under different adapters must not share them
    prompts = [shared, shared + ids(3), ids(23), ids(5), shared, ids(30), shared + ids(9), ids(11)]
    loras = [1, 2, 0, 3, 1, 2, 0, 3]  # lora_int_id per prompt (0: the base)
    return prompts, loras


def test_mixed_batch_matches_peft(setup):
    base, adapters, llm = setup
    reqs = {i + 1: LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)}
    prompts, loras = _workload()
    eng = llm.engine
    buckets = llm.stats()["num_buckets"]
    sp = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    done = {}
    # adapters arrive while requests run: half the requests first, the rest after a few steps
    for k, (p, lid) in enumerate(zip(prompts, loras)):
        if k == 4:
            for _ in range(5):
                done.update({o.request_id: o for o in eng.step() if o.finished})
            assert llm.add_lora(reqs[4])  # loaded now, used by no request
            with pytest.raises(ValueError, match="is not a directory"):  # refused; nothing in flight is lost
                llm.add_lora(LoRARequest("bad", 40, "/nonexistent/adapter"))
        eng.add_request(str(k), {"prompt_token_ids": p}, sp, lora_request=reqs[lid] if lid else None)
    with pytest.raises(ValueError, match="lora_int_id 1 is used by"):
        llm.remove_lora(1)
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for k, (p, lid) in enumerate(zip(prompts, loras)):
        want = peft_greedy(base, adapters[lid - 1] if lid else None, p, N_NEW)
        assert list(done[str(k)].outputs[0].token_ids) == want, (k, lid)
    s = llm.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hit_rate"] > 0, s
    assert s["lora_evictions"] > 0                  # 3 adapters in use, 2 device slots
    assert s["lora_loads"] > 4                      # the host cache (2) dropped some: read again from disk
    assert s["num_compilations"] == buckets         # loading and evicting never compiled a step
    assert llm.list_loras() == [1, 2, 3, 4]


def test_update_lora_in_place(setup, tmp_path):
    base, adapters, llm = setup
    p = [int(t) for t in np.random.default_rng(9).integers(3, 256, size=13)]
    sp = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    lr = LoRARequest("u", 9, adapters[0])

    def run():
        return list(llm.generate([{"prompt_token_ids": p}], sp, lora_request=lr)[0].outputs[0].token_ids)
    assert run() == peft_greedy(base, adapters[0], p, N_NEW)
    n = llm.stats()["num_compilations"]
    other = load_file(f"{adapters[0]}/adapter_model.safetensors")
    half = {k: v * 0.5 for k, v in other.items()}  # half of A and of B: a quarter of the delta
    shutil.copytree(adapters[0], tmp_path / "half")
    save_file(half, str(tmp_path / "half" / "adapter_model.safetensors"))
    llm.update_lora(9, half)
    assert run() == peft_greedy(base, str(tmp_path / "half"), p, N_NEW)
    llm.update_lora(9, {"a": {}, "b": {}})          # zeros: the base model
    assert run() == peft_greedy(base, None, p, N_NEW)
    llm.update_lora(9, other)
    assert run() == peft_greedy(base, adapters[0], p, N_NEW)
    assert llm.stats()["num_compilations"] == n
    with pytest.raises(ValueError, match="has shape"):
        llm.update_lora(9, {next(iter(other)): np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match="not registered"):
        llm.update_lora(99, other)


def test_logit_controls_with_an_adapter(setup):
    """Per-request logit controls still apply to a request that runs with an adapter."""
    base, adapters, llm = setup
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={77: 100.0})
    out = llm.generate([[5, 6, 7]], sp, lora_request=LoRARequest("a1", 2, adapters[1]))
    assert list(out[0].outputs[0].token_ids) == [77] * 4


def test_bad_requests(setup, tmp_path):
    base, adapters, llm = setup
    with pytest.raises(ValueError, match="already registered"):
        llm.add_lora(LoRARequest("other", 1, adapters[1]))
    with pytest.raises(ValueError, match="lora_name 'a0'"):
        llm.add_lora(LoRARequest("a0", 50, adapters[1]))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([[5, 6]], lora_request=LoRARequest("x", 51, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be"):
        LoRARequest("x", 0, adapters[0])
    assert not llm.remove_lora(77)
