"""The Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) against a live server over a tiny
model with a byte-level tokenizer, driven by the `openai` client: plain, streamed (raw events and the client's
`responses.stream`), a function tool, a JSON schema, chained by previous_response_id; greedy text equal to
chat completions'; bad input refused by field with nothing lost for other requests; the store's bound."""
import json

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict
from test_server import Server
from test_server_stall import make_byte_tokenizer

from jaxpaged.testing.tiny_models import make_tiny_model
from serve.responses_store import ResponseStore

STORED = 3  # --max-stored-responses
TOOL = {"type": "function", "name": "pick", "description": "pick a color", "parameters": {
    "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
    "additionalProperties": False}}


class Pick(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool


@pytest.fixture(scope="module")
def server(compile_cache, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("responses_model"))
    make_tiny_model(d, "llama", vocab_size=320, max_position_embeddings=1024)
    make_byte_tokenizer(d)
    srv = Server(d, compile_cache, str(tmp_path_factory.mktemp("logs") / "responses.log"),
                 extra=("--max-model-len", "1024", "--max-stored-responses", str(STORED)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_plain_equals_chat(client):
    r = client.responses.create(model="tiny", input="hi", instructions="be brief", max_output_tokens=8,
                                temperature=0)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "be brief"},
                                                                  {"role": "user", "content": "hi"}],
                                          max_completion_tokens=8, temperature=0)
    c = chat.choices[0]
    assert r.output_text == c.message.content and r.output_text
    assert r.object == "response" and r.id.startswith("resp") and r.instructions == "be brief"
    assert r.status == ("incomplete" if c.finish_reason == "length" else "completed")
    assert (r.incomplete_details is not None) == (r.status == "incomplete")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.output[0].type == "message" and r.output[0].role == "assistant"


def test_message_list_equals_chat(client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": [{"type": "input_text", "text": "more"}]}]
    r = client.responses.create(model="tiny", input=msgs, max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model="tiny", messages=msgs[:2] + [{"role": "user", "content": [{"type": "text", "text": "more"}]}],
        max_completion_tokens=6, temperature=0)
    assert r.output_text == chat.choices[0].message.content


def test_stream_events(client):
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=8, temperature=0, store=False)
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=8, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if plain.status == "incomplete" else "response.completed"], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == plain.output_text == final.output_text
    assert final.output[0].id == events[2].item.id and final.usage.output_tokens == plain.usage.output_tokens


def test_stream_helper_with_json_schema(client):
    with client.responses.stream(model="tiny", input="json please", text_format=Pick, max_output_tokens=60,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Pick)  # the client parsed our JSON into the model
    plain = client.responses.create(model="tiny", input="json please", max_output_tokens=60, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "Pick",
                                                     "schema": Pick.model_json_schema(), "strict": True}})
    assert Pick.model_validate_json(plain.output_text)


def test_function_tool_and_its_output(client):
    r = client.responses.create(model="tiny", input="choose", tools=[TOOL], max_output_tokens=40, temperature=0,
                                tool_choice={"type": "function", "name": "pick"})
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "pick", r.output
    assert json.loads(calls[0].arguments)["color"] in ("red", "blue")
    streamed = list(client.responses.create(model="tiny", input="choose", tools=[TOOL], max_output_tokens=40,
                                            temperature=0, tool_choice={"type": "function", "name": "pick"},
                                            stream=True))
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == calls[0].arguments and len(pieces) > 1  # as generated, not whole at the end
    with client.responses.stream(model="tiny", input="choose", tools=[TOOL], max_output_tokens=40, temperature=0,
                                 tool_choice={"type": "function", "name": "pick"}) as stream:
        final = stream.get_final_response()  # the client's assembly of the events
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert (call.name, call.arguments, call.status) == ("pick", calls[0].arguments, "completed")
    # the call and its output given back as input: the conversation goes on
    r2 = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, tools=[TOOL], input=[
        {"role": "user", "content": "choose"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "pick", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "done"}])
    assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens > r.usage.input_tokens


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="hi", max_output_tokens=5, temperature=0)
    second = client.responses.create(model="tiny", input="and?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    chat = client.chat.completions.create(model="tiny", max_completion_tokens=5, temperature=0, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and?"}])
    assert second.previous_response_id == first.id and second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_get_and_delete(client, server):
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    assert client.responses.delete(r.id) is None  # the client returns nothing for a 200
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("body,field", [
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format"),
])
def test_bad_input_named_and_nothing_lost(server, client, body, field):
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"].startswith(field) and err["param"].split(".")[0] in body, err
    assert "response_format" not in err["message"] and "messages" not in err["param"], err
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False).status


def test_store_bound(client):
    ids = [client.responses.create(model="tiny", input="hi", max_output_tokens=1).id for _ in range(STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the least recently used went first
    assert all(client.responses.retrieve(i).id == i for i in ids[1:])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id=ids[0])
    assert e.value.body["param"] == "previous_response_id"


def test_store_is_lru():
    store, made = ResponseStore(2), []
    for i in range(3):
        made.append(type("R", (), {"id": f"r{i}"})())
        store.put(made[-1], [])
        if i == 1:
            store.get("r0")  # read: r1 is now the least recently used
    assert store.get("r1") is None and store.get("r0") is not None and len(store) == 2
    assert ResponseStore(0).put(made[0], []) is None and len(ResponseStore(0)) == 0
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(-1)


def test_openapi_documents_the_routes(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert "post" in doc["paths"]["/v1/responses"]
    assert set(doc["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert doc["components"]["schemas"]["ResponsesRequest"]["properties"]["max_output_tokens"]["maximum"] == 1023
