"""The engine contract (jaxpaged/contract.py), one set of checks for every implementation: an LLMEngine, and
Replicas of 2 (both replicas on this process's first device: the contract, not the speed-up, is checked).

Statically: every member of `Engine` and `EngineControls` is on each implementation, with the protocol's
parameters (names, order, defaults). Running: add / step / abort, the limits, the stats' keys, bad input
(ValueError naming the field, nothing queued, nothing lost of what runs), and the controls (pause, sleep,
weights, LoRA) behaving alike."""
import inspect

import pytest

from jaxpaged.contract import Engine, EngineControls
from jaxpaged.controls.facet import Controls
from jaxpaged.core.sampling_params import SamplingParams
from jaxpaged.engine import LLMEngine
from jaxpaged.parallel.replica_controls import ReplicaControls
from jaxpaged.parallel.replicas import Replicas

IMPLEMENTATIONS = {"engine": (LLMEngine, Controls), "replicas": (Replicas, ReplicaControls)}
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
STATS = ("num_preemptions", "num_compilations", "kv_blocks_total", "kv_blocks_free", "kv_cache_usage",
         "prefix_cache_hit_rate", "num_running", "num_waiting", "iteration_tokens", "num_step_failures")


def _members(protocol) -> dict[str, object]:
    return {n: v for n, v in vars(protocol).items() if not n.startswith("_")}


def contract_gaps(protocol, cls) -> list[str]:
    """What `cls` lacks of `protocol`'s methods and properties: missing members, and parameters (by name,
    order, default) the protocol has and the class does not. Annotated attributes are checked on instances."""
    gaps = []
    for name, member in _members(protocol).items():
        mine = inspect.getattr_static(cls, name, None)
        if mine is None:
            gaps.append(f"{cls.__name__}.{name} is missing")
        elif isinstance(member, property) != isinstance(mine, property):
            gaps.append(f"{cls.__name__}.{name}: a property in one and not the other")
        elif callable(member):
            want = list(inspect.signature(member).parameters.values())
            have = list(inspect.signature(mine).parameters.values())[:len(want)]
            if [(p.name, p.default) for p in want] != [(p.name, p.default) for p in have]:
                gaps.append(f"{cls.__name__}.{name}{inspect.signature(mine)} is not {name}{inspect.signature(member)}")
    return gaps


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_implementations_have_every_member(impl):
    engine_cls, controls_cls = IMPLEMENTATIONS[impl]
    assert contract_gaps(Engine, engine_cls) == []
    assert contract_gaps(EngineControls, controls_cls) == []


def test_the_static_check_can_fail():
    class Short:
        def add_request(self, request_id, prompt, params=None):  # no arrival_time, stream, lora_request
            return ""

        is_paused = False  # a property in the protocol

    gaps = contract_gaps(Engine, Short)
    assert any(g.startswith("Short.add_request(") for g in gaps) and "Short.step is missing" in gaps
    assert any("is_paused" in g for g in contract_gaps(EngineControls, Short))


@pytest.fixture(scope="module", params=list(IMPLEMENTATIONS))
def engine(request, tiny_models, engine_kwargs):
    import jax

    from jaxpaged.config import EngineConfig
    kw = dict(engine_kwargs, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=24)
    if request.param == "engine":
        eng = LLMEngine(EngineConfig(model=tiny_models["llama"], **kw))
    else:  # two replicas on one device
        dev = jax.devices()[0]
        eng = Replicas(EngineConfig(model=tiny_models["llama"], data_parallel_size=2, **kw), devices=[dev, dev])
    yield eng
    if request.param == "replicas":
        eng.shutdown()


def _run(engine, limit: int = 100) -> dict:
    """Step until nothing is unfinished; the final outputs by request id."""
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("requests did not finish")


def test_attributes_and_limits(engine):
    for name in Engine.__annotations__:
        assert hasattr(engine, name), name
    limits = engine.request_limits()
    assert limits["max_model_len"] == engine.max_model_len == 64 and limits["vocab_size"] == 256


def test_add_step_finish(engine):
    engine.add_request("a", [3, 4, 5], GREEDY, stream=False)
    engine.add_request("b", [6, 7], GREEDY, stream=False)
    assert engine.can_step()
    done = _run(engine)
    assert sorted(done) == ["a", "b"] and all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    assert not engine.can_step()
    stats = engine.stats()
    assert set(STATS) <= set(stats) and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_abort(engine):
    engine.add_request("long", [3, 4, 5], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()
    engine.abort_request("long")
    engine.abort_request("never-added")  # a no-op
    done = _run(engine)
    assert done.get("long") is None or done["long"].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("bad, field", [
    (dict(prompt=[3] * 64), "prompt"),                                         # no room for a token
    (dict(params=SamplingParams(max_tokens=5, logprobs=10_000)), "logprobs"),
    (dict(lora_request="adapter"), "enable_lora"),
    (dict(request_id="keep"), "request id"),                                   # already in use
])
def test_bad_input_names_the_field_and_loses_nothing(engine, bad, field):
    engine.add_request("keep", [3, 4, 5], GREEDY, stream=False)
    args = dict(request_id="bad", prompt=[3, 4], params=GREEDY) | bad
    with pytest.raises(ValueError, match=field):
        engine.add_request(args.pop("request_id"), args.pop("prompt"), args.pop("params"), **args)
    done = _run(engine)
    assert list(done) == ["keep"] and len(done["keep"].outputs[0].token_ids) == 5


def test_controls(engine):
    c = engine.controls
    engine.add_request("p", [3, 4, 5], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()
    outs = c.pause_generation("abort")
    assert c.is_paused and [o.request_id for o in outs if o.finished] == ["p"]
    engine.add_request("held", [3, 4, 5], GREEDY, stream=False)
    assert not engine.can_step()  # paused: it waits
    c.resume_generation()
    first = _run(engine)["held"].outputs[0].token_ids
    c.sleep(1)
    assert c.sleep_level == 1 and not engine.can_step()
    c.wake_up()
    c.update_weights(c.get_weights())  # the same values: the same tokens
    engine.add_request("again", [3, 4, 5], GREEDY, stream=False)
    assert _run(engine)["again"].outputs[0].token_ids == first
    with pytest.raises(ValueError, match="enable_lora"):
        c.list_loras()
    assert engine.sleep_level == 0 and engine.is_paused is False  # the controls read as the engine's own
