"""Issue 13's families under tensor parallelism, on simulated CPU devices (a subprocess: the device
count is fixed when JAX starts). Mixtral with its experts split over 2 and 4 devices (expert
parallelism) and Gemma 3 (windows, soft-caps and scale forwarded through the shard_map'ed attention)
give one device's greedy tokens and routed experts (return_routed_experts, checked against HF on one
device in tests/test_routed_experts.py); the expert weights are never gathered."""
import json
import os
import subprocess
import sys

import pytest

from jaxpaged.testing.xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = r'''
import json, re, sys
import jax, numpy as np
from jaxpaged import LLM, SamplingParams
from jaxpaged.testing.tiny_models import make_tiny_model
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 256, size=n)]} for n in (5, 23, 41)]
sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
routes = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, return_routed_experts=True)
out = {}
for family in ("mixtral", "gemma3"):
    path = make_tiny_model(f"{sys.argv[1]}/{family}", family, seed=14)
    for tp in (1, 2, 4):
        llm = LLM(model=path, dtype="float32", block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                  max_model_len=128, tensor_parallel_size=tp, compilation_cache_dir=None, show_progress=False)
        outs = llm.generate(prompts, routes if family == "mixtral" else sp, use_tqdm=False)
        r = llm.engine.runner
        fact = dict(tokens=[o.outputs[0].token_ids for o in outs])
        if family == "mixtral":  # routed experts (return_routed_experts) of prompt and generated tokens
            fact["routes"] = [np.concatenate([o.prompt_routed_experts, o.outputs[0].routed_experts]).tolist()
                              for o in outs]
            fact["expert_shard"] = list(r.params["layers"]["w_up"].addressable_shards[0].data.shape)
            hlo = r.compiled_step((r.buckets[-1], False)).as_text()
            # an all-gather whose result has the shape of the experts' weights ([.., E, D, F] / [.., E, F, D])
            E, D, F = 4, 64, 128
            pat = re.compile(rf"= f32\[(\d+,)?{E},({D},{F}|{F},{D})\]")
            fact["expert_gathers"] = [l.strip()[:120] for l in hlo.splitlines()
                                      if "all-gather(" in l and pat.search(l.split("all-gather(")[0])]
        out[f"{family}_tp{tp}"] = fact
print(json.dumps(out))
'''


@pytest.mark.slow
def test_new_families_under_tensor_parallelism(tmp_path):
    env = {**subprocess_env(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    f = json.loads(r.stdout.strip().splitlines()[-1])
    for family in ("mixtral", "gemma3"):
        for tp in (2, 4):
            assert f[f"{family}_tp{tp}"]["tokens"] == f[f"{family}_tp1"]["tokens"], (family, tp)
    for tp in (2, 4):
        assert f[f"mixtral_tp{tp}"]["routes"] == f["mixtral_tp1"]["routes"], tp
    assert [len(r) for r in f["mixtral_tp1"]["routes"]] == [5 + 9, 23 + 9, 41 + 9]  # one per token but the last
    for tp in (1, 2, 4):  # [L, E/tp, D, F] per device: 4 experts split
        assert f[f"mixtral_tp{tp}"]["expert_shard"][1] == 4 // tp
        assert not f[f"mixtral_tp{tp}"]["expert_gathers"], tp
