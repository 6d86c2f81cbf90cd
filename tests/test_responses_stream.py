"""The streamed /v1/responses events of an answer with function calls (no server: the event writer driven by
a job's outputs as the engine grows them): under `tool_choice` auto the calls' arguments go out in
`response.function_call_arguments.delta` events as the tool parser reads them, and the items put together
equal the unstreamed answer's; a call that turns out not to be one (cut by max_output_tokens) ends
`incomplete` and its text goes out as a message; a named function's arguments, and `tool_choice` required's
calls, stream as they come."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from serve import tools
from serve.reasoning import make_parser
from serve.responses_protocol import ResponsesRequest
from serve.responses_render import output_items
from serve.responses_store import ResponseStore
from serve.responses_stream import events
from serve.tool_parsers import make_tool_parser

TOOL = {"type": "function", "name": "pick", "parameters": {"type": "object", "properties": {
    "color": {"type": "string"}, "n": {"type": "integer"}}}}
CALLS = ('Sure. <tool_call>{"name": "pick", "arguments": {"color": "dark red", "n": 12}}</tool_call>\n'
         '<tool_call>{"name": "pick", "arguments": {"color": "blue"}}</tool_call>')


def run(text: str, mode: str, reason: str = "stop", size: int = 3, named: str | None = None):
    """The events (parsed) of `text` streamed `size` characters an output, and the server's state."""
    st = SimpleNamespace(reasoning=make_parser(None), tool_parser=make_tool_parser("hermes"), model_name="tiny",
                         responses=ResponseStore(4))
    req = ResponsesRequest(model="tiny", input="choose", stream=True, tools=[TOOL])
    plan = SimpleNamespace(chat_plan=SimpleNamespace(mode=mode, named=named, schemas=tools.schemas_of(None)),
                           history=[{"role": "user", "content": "choose"}])

    async def outputs():
        for end in range(size, len(text) + size, size):
            done = end >= len(text)
            yield None, SimpleNamespace(outputs=[SimpleNamespace(
                text=text[:end], token_ids=list(range(end)), logprobs=None,
                finish_reason=reason if done else None)])

    job = SimpleNamespace(id="resp_1", created=0, outputs=outputs, usage=lambda: None)

    async def collect():
        return [e async for e in events(st, req, plan, job)]

    got = asyncio.run(collect())
    return [json.loads(e.split("data: ", 1)[1]) for e in got], st


def arguments_by_item(evs) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in evs:
        if e["type"] == "response.function_call_arguments.delta":
            out.setdefault(e["item_id"], []).append(e["delta"])
    return out


@pytest.mark.parametrize("size", [1, 3, 500])
def test_auto_calls_stream_their_arguments_and_equal_the_unstreamed(size):
    evs, st = run(CALLS, "auto", size=size)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = evs[-1]["response"]
    assert evs[-1]["type"] == "response.completed"
    content, calls = tools.parse("auto", CALLS, None, st.tool_parser, {})
    whole = output_items(None, content, calls)
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in final["output"]] == \
        [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in whole]
    assert final["output"][0]["content"][0]["text"] == "Sure."
    pieces = arguments_by_item(evs)
    for item in final["output"][1:]:
        assert "".join(pieces[item["id"]]) == item["arguments"] and item["status"] == "completed"
    if size < 500:  # generated a few characters at a time: the arguments come in pieces, not whole at the end
        assert len(pieces[final["output"][1]["id"]]) > 2
    added = [e["item"] for e in evs if e["type"] == "response.output_item.added"]
    assert [(i["type"], i.get("arguments")) for i in added] == [("message", None), ("function_call", ""),
                                                                 ("function_call", "")]
    # the calls and their arguments are in the stored conversation
    stored = st.responses.get("resp_1").messages[-1]
    assert [c["function"]["arguments"] for c in stored["tool_calls"]] == [c.function.arguments for c in calls]


def test_auto_call_cut_short_is_incomplete_and_its_text_a_message():
    text = CALLS[:60]  # inside the first call's arguments
    evs, st = run(text, "auto", reason="length")
    final = evs[-1]["response"]
    assert evs[-1]["type"] == "response.incomplete"
    kinds = [(i["type"], i["status"]) for i in final["output"]]
    assert kinds == [("message", "completed"), ("function_call", "incomplete"), ("message", "completed")], kinds
    texts = [i["content"][0]["text"] for i in final["output"] if i["type"] == "message"]
    assert "".join(texts) == text  # the whole answer, as content
    stored = st.responses.get("resp_1").messages[-1]
    assert "tool_calls" not in stored and stored["content"] == "".join(texts)


def test_named_call_streams_its_arguments():
    args = '{"color": "red", "n": 3}'
    evs, _ = run(args, "named", named="pick", size=2)
    final = evs[-1]["response"]
    (item,) = final["output"]
    assert item["type"] == "function_call" and item["name"] == "pick" and item["arguments"] == args
    assert "".join(arguments_by_item(evs)[item["id"]]) == args and len(arguments_by_item(evs)[item["id"]]) > 2
    done = [e for e in evs if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == args and done[0]["name"] == "pick"


def test_named_call_cut_short_is_incomplete_and_its_text_a_message():
    args = '{"color": "re'
    evs, st = run(args, "named", named="pick", reason="length")
    final = evs[-1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [("function_call", "incomplete"),
                                                                    ("message", "completed")]
    assert final["output"][1]["content"][0]["text"] == args  # the unstreamed response's content
    stored = st.responses.get("resp_1").messages[-1]
    assert "tool_calls" not in stored and stored["content"] == args


REQUIRED = '[{"name": "pick", "arguments": {"color": "dark r\u00e9d"}}, {"name": "pick", "arguments": {"n": 20}}]'


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_required_calls_stream_their_arguments(reason):
    text = REQUIRED if reason == "stop" else REQUIRED[:50]  # cut: inside the first call's arguments
    evs, st = run(text, "required", reason=reason, size=2)
    final = evs[-1]["response"]
    pieces = arguments_by_item(evs)
    first = final["output"][0]
    assert first["type"] == "function_call" and len(pieces[first["id"]]) > 2  # in pieces as generated
    if reason == "stop":
        _, calls = tools.parse("required", text, None)
        assert [(i["name"], i["arguments"], i["status"]) for i in final["output"]] == \
            [(c.function.name, c.function.arguments, "completed") for c in calls]
        assert all("".join(pieces[i["id"]]) == i["arguments"] for i in final["output"])
    else:  # no call, as unstreamed: the text is the content
        assert [(i["type"], i["status"]) for i in final["output"]] == [("function_call", "incomplete"),
                                                                        ("message", "completed")]
        assert final["output"][1]["content"][0]["text"] == text
        assert st.responses.get("resp_1").messages[-1] == {"role": "assistant", "content": text}
