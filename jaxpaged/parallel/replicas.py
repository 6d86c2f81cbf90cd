"""Data parallelism: `Replicas`, M LLMEngines (each on its own group of devices, with its own scheduler and
block pool) behind one `Engine` (jaxpaged/contract.py), so `LLM` and the AsyncEngine/server drive it as they
drive one engine; its controls reach every replica (`replica_controls.py`).

Routing (`route`): a request whose first full block of prompt tokens was routed before goes to the same
replica (its prefix cache likely holds that block), unless that replica is overloaded: its outstanding
tokens exceed the least-loaded replica's by more than AFFINITY_SLACK_STEPS steps' token budget. Every
other request goes to the replica with the fewest outstanding tokens (prompt tokens not yet computed plus
output tokens not yet generated, over its unfinished requests).

`step()` steps every replica that has work, each on its own thread: JAX releases the GIL while a step runs,
so the replicas' device work overlaps.
"""
from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from jaxpaged.config import EngineConfig
from jaxpaged.contract import ControlsFront, Engine
from jaxpaged.core import prompt_embeds
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.core.structured import StructuredOutputsParams
from jaxpaged.core.validation import prompt_ids
from jaxpaged.engine import LLMEngine, RequestOutput
from jaxpaged.parallel.replica_controls import ReplicaControls
from jaxpaged.step.mesh import device_groups

AFFINITY_SLACK_STEPS = 4     # affinity yields when the cached replica is this many full steps behind
AFFINITY_MAP_SIZE = 1 << 16  # first blocks remembered by the router (least recently routed dropped first)

_RATIOS = ("kv_cache_usage", "prefix_cache_hit_rate")
_SAME = ("tensor_parallel_size", "num_buckets", "block_size")  # equal on every replica: reported once, not summed


class Replicas(ControlsFront):
    """`config.data_parallel_size` engines on `mesh.device_groups(tp, dp, devices)`, one front."""

    def __init__(self, config: EngineConfig, devices: list | None = None):
        groups = device_groups(config.tensor_parallel_size, config.data_parallel_size, devices)
        self.engines = [LLMEngine(config, devices=g) for g in groups]
        first = self.engines[0]
        self.config, self.tokenizer = config, first.tokenizer
        self.model_config, self.max_model_len = first.model_config, first.max_model_len
        self.eos_token_ids, self.model_dir = first.eos_token_ids, first.model_dir
        self.controls = ReplicaControls(weakref.proxy(self))  # held weakly: no reference cycle
        self._owner: dict[str, int] = {}                       # unfinished request id -> replica
        self._affinity: OrderedDict[tuple, int] = OrderedDict()  # first block's token ids -> replica
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="jaxpaged-replica")

    # -- routing --------------------------------------------------------------------------
    @staticmethod
    def outstanding_tokens(engine: LLMEngine) -> int:
        """Tokens the engine still has to compute: uncomputed prompt + ungenerated output, all requests."""
        n = 0
        for group in engine.groups.values():
            for r in group.samples:
                if not r.is_finished:
                    n += max(0, len(r.token_ids) - r.num_computed_tokens) + r.params.max_tokens - r.num_output_tokens
        return n

    def route(self, token_ids: list[int]) -> int:
        """The replica for a prompt (see the module docstring); remembers its first block."""
        load = [self.outstanding_tokens(e) for e in self.engines]
        least = min(range(len(load)), key=load.__getitem__)
        bs = self.config.block_size
        key = tuple(token_ids[:bs]) if len(token_ids) > bs else None  # a full block the cache can hold
        if key is None:
            return least
        chosen = self._affinity.get(key)
        slack = AFFINITY_SLACK_STEPS * self.config.max_num_batched_tokens
        if chosen is None or load[chosen] > load[least] + slack:
            chosen = least
        self._affinity[key] = chosen
        self._affinity.move_to_end(key)
        if len(self._affinity) > AFFINITY_MAP_SIZE:
            self._affinity.popitem(last=False)
        return chosen

    def replica_of(self, request_id: str) -> int | None:
        return self._owner.get(str(request_id))

    def forget_finished(self, outputs: list[RequestOutput]) -> None:
        """Drop the owners of the finished requests among `outputs`."""
        for o in outputs:
            if o.finished:
                self._owner.pop(o.request_id, None)

    # -- the Engine contract ----------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True, lora_request=None) -> str:
        """Route and queue a request; ValueError (nothing queued) if it is invalid. Returns its id."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        embeds = isinstance(prompt, dict) and prompt_embeds.PARAM in prompt  # no token ids: routed by load
        ids = [] if embeds else prompt_ids(prompt, self.tokenizer, self.model_dir)[1]
        r = self.route(ids)
        self.engines[r].add_request(request_id, prompt, params, arrival_time, stream, lora_request)
        self._owner[request_id] = r
        return request_id

    def prepare_structured(self, structured_outputs: StructuredOutputsParams) -> None:
        """LLMEngine.prepare_structured: the matcher compiled once (replica 0's tokenizer; the replicas' are the
        same), copied by whichever replica runs the request."""
        self.engines[0].prepare_structured(structured_outputs)

    def abort_request(self, request_id: str) -> None:
        """Abort on the owning replica (a no-op for unknown or finished ids)."""
        r = self._owner.pop(str(request_id), None)
        if r is not None:
            self.engines[r].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def request_limits(self) -> dict:
        """The bounds every request is checked against: the replicas are identical, so replica 0's."""
        return self.engines[0].request_limits()

    @property
    def num_consecutive_step_failures(self) -> int:
        """The worst replica's run of failed steps (the server stops when any replica cannot step)."""
        return max(e.num_consecutive_step_failures for e in self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work (concurrently); their outputs, replica by replica."""
        busy = [e for e in self.engines if e.can_step()]
        if len(busy) == 1:
            results = [busy[0].step()]
        else:
            results = list(self._pool.map(LLMEngine.step, busy))
        outputs = [o for res in results for o in res]
        self.forget_finished(outputs)
        return outputs

    def stats(self) -> dict:
        """Sums over the replicas (ratios recomputed from the sums), plus `replicas`: each one's stats."""
        per = [e.stats() for e in self.engines]
        total = {}
        for k, v in per[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _RATIOS \
                    and not k.endswith("_per_device") and k not in _SAME:
                total[k] = sum(s[k] for s in per)
            else:
                total[k] = v
        used = sum(s["kv_blocks_total"] - s["kv_blocks_free"] for s in per)
        total["kv_cache_usage"] = used / total["kv_blocks_total"]
        hits = sum(e.block_manager.hit_tokens for e in self.engines)
        queried = sum(e.block_manager.queried_tokens for e in self.engines)
        total["prefix_cache_hit_rate"] = hits / queried if queried else 0.0
        its = [s["iteration_tokens"] for s in per]  # tokens per step: every replica's steps together
        total["iteration_tokens"] = dict(its[0], counts=[sum(c) for c in zip(*(i["counts"] for i in its))],
                                         sum=sum(i["sum"] for i in its))
        total["data_parallel_size"] = len(self.engines)
        total["replicas"] = per
        return total

    def can_step(self) -> bool:
        return any(e.can_step() for e in self.engines)

    def score(self, prompts: list, continuations: list) -> list[list[float]]:
        """Replica 0 scores (every replica holds the same weights)."""
        return self.engines[0].score(prompts, continuations)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def build_engine(config: EngineConfig) -> Engine | None:
    """The engine `config` asks for: an LLMEngine, Replicas when data_parallel_size > 1, or in a multi-host
    job (num_processes > 1, after `multihost.initialize`) the leader's engine, or None on a follower once
    the leader has stopped."""
    if config.num_processes > 1:
        from jaxpaged.parallel import multihost
        return multihost.build_engine(config)
    if config.data_parallel_size > 1:
        return Replicas(config)
    return LLMEngine(config)
