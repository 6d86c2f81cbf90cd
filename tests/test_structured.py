"""Structured outputs and tools on the default model (SmolLM2-135M-Instruct), through a real server and the
real openai client: outputs satisfy their constraint, bad constraints are 400s, unconstrained neighbours
are unchanged (slow). Fast: the engine on a tiny model with a byte-level tokenizer, the tool-call parser."""
import asyncio
import json
import re
from enum import Enum

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from test_server import Server

from jaxpaged.checkpoints.default_model import default_model_dir
from jaxpaged.core.structured import StructuredOutputsParams
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model
from serve import tools


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas have
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address


class Palette(BaseModel):
    colors: list[Color] = Field(min_length=1, max_length=3)
    favorite: Color


class Measure(BaseModel):
    temperature: float = Field(ge=-50, le=60)
    readings: list[int] = Field(max_length=4)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(compile_cache, tmp_path_factory):
    srv = Server(default_model_dir(), compile_cache, str(tmp_path_factory.mktemp("logs") / "structured.log"),
                 extra=("--max-model-len", "512"), fast_compile=False)  # the default model, many tokens
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.mark.slow
@pytest.mark.parametrize("model,prompt", [(Person, "Describe a person who lives in Paris as JSON."),
                                          (Palette, "Pick some colors."), (Measure, "Report a measurement.")])
def test_parse_pydantic_models(client, model, prompt):
    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": prompt}],
                                      response_format=model, temperature=0, max_tokens=120)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(c.message.parsed, model)
    model.model_validate_json(c.message.content)


@pytest.mark.slow
def test_choice_and_regex(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       temperature=0, max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="My phone number is", max_tokens=12, temperature=0.8,
                                  seed=3, n=2, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    for c in r.choices:
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text), c.text


@pytest.mark.slow
def test_named_and_required_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER], tool_choice=named,
                                       temperature=0, max_tokens=40)
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert args["unit"] in ("celsius", "fahrenheit")
    stream = client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER],
                                            tool_choice=named, temperature=0, max_tokens=40, stream=True)
    name, pieces, ids = None, [], set()
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            name = d.function.name or name
            ids.add(d.id) if d.id else None
            pieces.append(d.function.arguments or "")
    assert name == "get_weather" and len(ids) == 1 and json.loads("".join(pieces)) == args
    r = client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER],
                                       tool_choice="required", temperature=0, max_tokens=150)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message.content
    for call in c.message.tool_calls:
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    stream = client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER],
                                            tool_choice="required", temperature=0, max_tokens=150, stream=True)
    calls, reasons = {}, []
    for chunk in stream:
        ch = chunk.choices[0]
        reasons.append(ch.finish_reason)
        for d in ch.delta.tool_calls or []:
            calls.setdefault(d.index, ["", ""])
            calls[d.index][0] += d.function.name or ""
            calls[d.index][1] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    assert [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    r = client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=[WEATHER], temperature=0,
                                       max_tokens=40)  # "auto": the tools are in the prompt, the model decides
    m = r.choices[0]
    assert m.message.content or m.message.tool_calls
    assert (m.finish_reason == "tool_calls") == bool(m.message.tool_calls)


@pytest.mark.slow
@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")])
def test_bad_constraints_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK_WEATHER, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.slow
def test_unconstrained_neighbours_unchanged(server):
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    plain = dict(model="tiny", prompt="The capital of France is", max_tokens=16, temperature=0)

    async def run():
        alone = await aclient.completions.create(**plain)
        constrained = [aclient.completions.create(model="tiny", prompt=f"Person {i} as JSON:", max_tokens=16,
                                                  temperature=0, extra_body={"structured_outputs": {
                                                      "json": Person.model_json_schema()}}) for i in range(3)]
        together = await asyncio.gather(aclient.completions.create(**plain), *constrained)
        return alone, together[0]
    alone, together = asyncio.run(run())
    assert together.choices[0].text == alone.choices[0].text


def test_auto_tool_call_parser():
    content, calls = tools.parse("auto", 'Sure. <tool_call>[{"name": "get_weather", "arguments": '
                                         '{"city": "Paris"}}]</tool_call>', None)
    assert content == "Sure." and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    content, calls = tools.parse("auto", '<tool_call>\n{"name": "f", "parameters": {}}\n</tool_call>', None)
    assert content is None and calls[0].function.name == "f"
    assert tools.parse("auto", "<tool_call>not json</tool_call>", None) == (
        "<tool_call>not json</tool_call>", [])


@pytest.mark.slow
def test_matcher_state_survives_recompute():
    """The matcher follows the request's output tokens, so dropping the KV (preemption, prefix hit)
    and recomputing cannot change it: feed the same tokens twice, masks equal."""
    import numpy as np

    from jaxpaged.core.request import Request
    from jaxpaged.core.sampling_params import SamplingParams
    from jaxpaged.core.structured import StructuredOutputs
    from jaxpaged.core.tokenizer import Tokenizer
    d = default_model_dir()
    tok = Tokenizer.from_dir(d)
    so = StructuredOutputs(d + "/tokenizer.json", 49152, 2, [tok.eos_token_id])
    p = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}))
    prompt = tok.encode("x")
    out = tok.encode('{"a": 12', add_special_tokens=False)
    req = Request("r", "r", 0, prompt, p, 0)
    req.slot = 0
    masks = []
    for k in range(len(out) + 1):
        req.token_ids = prompt + out[:k]
        req.num_computed_tokens = len(req.token_ids) - 1
        masks.append(so.bitmask_arrays([(req, 1)], 2)["bitmask"][0].copy())
    # recompute from scratch (preempted): a fresh request object with the same tokens, prefilled at once
    again = Request("r2", "r2", 0, prompt, p, 0)
    again.slot, again.token_ids = 1, prompt + out
    again.num_computed_tokens = 0
    m = so.bitmask_arrays([(again, len(again.token_ids))], 2)["bitmask"]
    assert np.array_equal(m[1], masks[-1]) and (m[0] == -1).all()
    both = so.bitmask_arrays([(req, 1), (again, len(again.token_ids))], 2)["bitmask"]  # filled in parallel
    assert np.array_equal(both[0], masks[-1]) and np.array_equal(both[1], masks[-1])
    allowed = [t for t in range(49152) if masks[-1][t // 32] >> (t % 32) & 1]
    bad = [tok.decode([t], skip_special_tokens=False) for t in allowed
           if not re.fullmatch(r"[0-9\s,}\"]*", tok.decode([t], skip_special_tokens=False))]
    assert allowed and not bad, bad[:20]


@pytest.mark.slow
def test_preemption_and_prefix_hits_keep_matchers(compile_cache):
    """Constrained requests (n=2 too) run alone, then all together in a pool too small for them
    (preemption, recompute) after their prompts were cached (prefix hits): the same outputs, all valid."""
    from jaxpaged import LLM, SamplingParams
    llm = LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=16,
              compilation_cache_dir=compile_cache, show_progress=False)
    so = StructuredOutputsParams(json=Person.model_json_schema())
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=so),
              SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=64, structured_outputs=so)]
    chats = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(3)]
    work = [(c, params[i % 2]) for i, c in enumerate(chats)]
    alone = [llm.chat([c], p, use_tqdm=False)[0] for c, p in work]
    hits = llm.stats()["prefix_cache_hit_rate"]
    together = llm.chat([c for c, _ in work], [p for _, p in work], use_tqdm=False)
    st = llm.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_rate"] > hits > 0
    for a, b in zip(alone, together):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in b.outputs:
            assert c.finish_reason == "stop"
            Person.model_validate_json(c.text)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, engine_kwargs):
    from jaxpaged import LLM
    path = str(tmp_path_factory.mktemp("structured_model"))
    make_tiny_model(path, "llama", vocab_size=320, seed=3, initializer_range=0.3)
    add_tiny_tokenizer(path)
    return LLM(model=path, **engine_kwargs)


def test_engine_constraints_on_a_tiny_model(tiny_llm):
    """Constrained and unconstrained requests share a batch: constraints hold (n=2, sampled), the request
    stops when its grammar is complete, the unconstrained neighbour's tokens are those it gets alone, and
    logprobs are those of the raw distribution."""
    from jaxpaged import SamplingParams
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    alone = tiny_llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0]
    so = [StructuredOutputsParams(regex="[ab]{3,6}"), StructuredOutputsParams(choice=["hello", "world"]),
          StructuredOutputsParams(json={"type": "object", "properties": {"k": {"enum": [1, 2]}},
                                        "required": ["k"], "additionalProperties": False})]
    params = [plain] + [SamplingParams(max_tokens=40, temperature=1.0, seed=i, n=2, structured_outputs=c)
                        for i, c in enumerate(so)] + [SamplingParams(max_tokens=12, temperature=0, logprobs=1,
                                                                     structured_outputs=so[1])]
    outs = tiny_llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.token_ids
    for a, b in zip(outs[0].outputs[0].logprobs, alone.logprobs):  # other bucket shapes: float noise only
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-4) for k in a)
    for c in outs[1].outputs:
        assert re.fullmatch("[ab]{3,6}", c.text) and c.finish_reason == "stop", c.text
    for c in outs[2].outputs:
        assert c.text in ("hello", "world") and c.finish_reason == "stop"
    for c in outs[3].outputs:
        assert json.loads(c.text)["k"] in (1, 2) and c.finish_reason == "stop", c.text
    first = outs[4].outputs[0].logprobs[0]  # same prompt as `alone`: the raw top token is alone's first
    assert first[alone.token_ids[0]] == pytest.approx(alone.logprobs[0][alone.token_ids[0]], abs=1e-4)


def test_structured_params_are_checked():
    from jaxpaged import SamplingParams
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs.regex") as e:
        StructuredOutputsParams(regex="a(b")
    assert "unclosed group" in str(e.value)
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_structured_params_compiled_once(monkeypatch):
    """SamplingParams and add_request check a StructuredOutputsParams again: unchanged, it is not recompiled;
    changed, it is (and its prepared matcher dropped)."""
    import llguidance

    from jaxpaged import SamplingParams
    calls, real = [], llguidance.grammar_from
    monkeypatch.setattr(llguidance, "grammar_from", lambda kind, text: calls.append(kind) or real(kind, text))
    so = StructuredOutputsParams(json={"type": "object"})
    SamplingParams(structured_outputs=so).validate()
    assert calls == ["json_schema"]
    so.template = object()  # as StructuredOutputs.prepare leaves it
    so.json["properties"] = {"a": {"type": "integer"}}  # changed in place
    so.validate()
    assert calls == ["json_schema"] * 2 and so.template is None


def test_constraint_after_reasoning(tiny_llm):
    """A ReasoningSpan puts the model's free text before the constraint (vLLM constrains a reasoning model's
    answer only): while it reasons any text may come (not a special token); after the end marker only the
    constraint's (blanks first allowed); with an opening marker the reasoning block is optional. Sampled on
    the tiny model, the text past the first end marker is the constraint's and ends the request."""
    from jaxpaged import SamplingParams
    from jaxpaged.core.reasoned import ReasoningSpan
    from jaxpaged.core.request import Request
    from jaxpaged.core.structured import StructuredOutputs
    with pytest.raises(ValueError, match="structured_outputs.reasoning"):
        StructuredOutputsParams(regex="a", reasoning="</t>")
    tok = tiny_llm.tokenizer
    host = StructuredOutputs(tiny_llm.engine.structured.tokenizer_json, 320, 1, [2])
    texts = {t: tok.decode([t], skip_special_tokens=False) for t in range(3, 300)}  # 0-2: <pad>, <s>, </s>

    def allowed(span, text):
        p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["hello"], reasoning=span))
        req = Request("r", "r", 0, [5], p, 0)
        req.slot, req.token_ids = 0, [5] + tok.encode(text, add_special_tokens=False)
        req.num_computed_tokens = len(req.token_ids) - 1
        row = host.bitmask_arrays([(req, 1)], 1)["bitmask"][0]
        return {t for t in range(320) if row[t // 32] >> (t % 32) & 1}

    text = {t for t in texts if "\ufffd" not in texts[t]}  # whole characters (a lone byte may not start text)
    inside, optional = ReasoningSpan(end="</t>"), ReasoningSpan(end="</t>", start="<t>")
    for span, before in ((inside, ""), (inside, "why <t"), (optional, "<t>why")):
        assert text <= allowed(span, before) <= set(texts), (span, before)  # any text, never a special token
    for span, before in ((inside, "why</t>"), (optional, "<t>why</t>")):
        after = allowed(span, before)
        assert after and all("hello".startswith(texts[t].lstrip()) for t in after), [texts[t] for t in after]
    first = {texts[t][:1] for t in allowed(optional, "")}  # the opening marker or the answer, nothing else
    assert "<" in first and "h" in first and first <= {"<", "h"}, first
    b = tok.encode("b", add_special_tokens=False)
    so = StructuredOutputsParams(choice=["hello", "world"], reasoning=ReasoningSpan(end="b"))
    p = SamplingParams(max_tokens=80, temperature=1.0, seed=2, n=2, logit_bias={b[0]: 5.0}, structured_outputs=so)
    for c in tiny_llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], p, use_tqdm=False)[0].outputs:
        thought, end, answer = c.text.partition("b")
        assert end and answer.strip() in ("hello", "world") and c.finish_reason == "stop", c.text
