"""update_weights from a trainer's layout, on 8 simulated CPU devices; run by tests/test_reshard.py in a
subprocess (XLA_FLAGS must already hold --xla_force_host_platform_device_count=8).

`python tests/reshard_checks.py WORKDIR` prints one JSON object on its last line: the facts the test asserts.
The engine runs tensor parallel 4 x data parallel 2; the trainer holds the new weights FSDP-sharded over all
8 devices (each leaf's first axis split 8 ways where it divides, else replicated).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np


def main(workdir: str) -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.testing.tiny_models import make_tiny_model
    path = make_tiny_model(os.path.join(workdir, "m"), "llama", num_heads=8, num_kv_heads=4, seed=3)
    kw = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              compilation_cache_dir=None, show_progress=False)
    prompts = [{"prompt_token_ids": [3 + i, 17, 9, 40 + i, 5]} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(model=path, tensor_parallel_size=4, data_parallel_size=2, **kw)
    rng = np.random.default_rng(0)
    new = jax.tree.map(lambda a: (np.asarray(a) + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype),
                       llm.get_weights())
    fsdp = Mesh(np.array(jax.devices()), ("fsdp",))

    def shard(a):  # the trainer's layout
        spec = P("fsdp") if a.ndim and a.shape[0] % 8 == 0 else P()
        return jax.device_put(a, NamedSharding(fsdp, spec))
    engines = llm.engine.engines
    before = [[a.sharding for a in jax.tree.leaves(e.runner.params)] for e in engines]
    trainer = jax.tree.map(shard, new)
    jax.block_until_ready(trainer)
    with jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"):
        llm.update_weights(trainer)  # device to device only: a host transfer would raise here
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    specs_kept = all(a.sharding.is_equivalent_to(b, a.ndim) for e, shardings in zip(engines, before)
                     for a, b in zip(jax.tree.leaves(e.runner.params), shardings))
    values_equal = all(np.array_equal(np.asarray(a), b) for e in engines
                       for a, b in zip(jax.tree.leaves(e.runner.params), jax.tree.leaves(new)))
    devices = [sorted(d.id for d in jax.tree.leaves(e.runner.params)[0].sharding.device_set) for e in engines]
    ref = LLM(model=path, **kw)
    ref.update_weights(new)  # numpy arrays on one device
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    return dict(tokens=got, reference=want, values_equal=values_equal, shardings_kept=specs_kept,
                replica_devices=devices, compilations=llm.stats()["num_compilations"])


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
