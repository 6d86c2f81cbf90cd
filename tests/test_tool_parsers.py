"""The tool-call syntaxes of `--tool-call-parser` (serve/tool_parsers/): for each, one call, several calls,
content before a call and malformed output (content, no calls), read whole; the same texts streamed in
pieces, whose deltas put together equal the whole text's reading; qwen3_coder's values converted by the
tools' schemas; pythonic's literals read without evaluating anything; the flag's choices from the registry.
No engine: the parsers are functions of text."""
import argparse
import json

import pytest

from serve import tools
from serve.config import add_server_args
from serve.tool_parsers import PARSERS, make_tool_parser
from serve.tool_parsers.partial_json import prefix
from serve.tool_parsers.stream import ToolCallStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
SCHEMAS = {"get_weather": WEATHER}

# name -> {case: (text, content, [(name, arguments)])}; "malformed" texts are content with no calls
CASES = {
    "hermes": {
        "one": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>', None,
                [("get_weather", {"city": "SF"})]),
        "several": ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>[{"name": "b", "parameters": '
                    '{"x": 1}}, {"name": "c", "arguments": {}}]</tool_call>', None,
                    [("a", {}), ("b", {"x": 1}), ("c", {})]),
        "before": ('Let me look.\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
                   "Let me look.", [("get_weather", {"city": "Rome"})]),
        "malformed": '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", '
                     '"arguments": {"city": </tool_call>',  # one block that does not parse: no calls at all
    },
    "llama3_json": {
        "one": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "SF", "days": 2}}', None,
                [("get_weather", {"city": "SF", "days": 2})]),
        "several": ('{"name": "a", "parameters": {"q": "x {y} [z]"}}; {"name": "b", "arguments": {}} ; '
                    '{"name": "c", "parameters": {"n": {"m": {"k": 1}}}}', None,
                    [("a", {"q": "x {y} [z]"}), ("b", {}), ("c", {"n": {"m": {"k": 1}}})]),
        "before": ('Here you go: {"name": "get_weather", "parameters": {"city": "Oslo"}} Anything else?',
                   "Here you go: Anything else?", [("get_weather", {"city": "Oslo"})]),
        "malformed": '{"name": "get_weather", "parameters": {city: "SF"}}',
    },
    "mistral": {
        "one": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "SF"}}]', None,
                [("get_weather", {"city": "SF"})]),
        "several": ('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b{"y": [2]}[TOOL_CALLS][{"name": "c", "arguments": {}}]',
                    None, [("a", {"x": 1}), ("b", {"y": [2]}), ("c", {})]),
        "before": ('Checking the weather. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}]',
                   "Checking the weather.", [("get_weather", {"city": "Lima"})]),
        "malformed": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "SF"}',
    },
    "pythonic": {
        "one": ("[get_weather(city='San Francisco', days=3)]", None,
                [("get_weather", {"city": "San Francisco", "days": 3})]),
        "several": ("[a(), register_user(name=\"J\\\"D\", age=-37, address={'city': 'SF'}, role=None, ok=True, "
                    "aliases=['J', 'Jo'], pair=(1, 2.5))]", None,
                    [("a", {}), ("register_user", {"name": 'J"D', "age": -37, "address": {"city": "SF"},
                                                   "role": None, "ok": True, "aliases": ["J", "Jo"],
                                                   "pair": [1, 2.5]})]),
        "before": ("I'll check [x] first.\n[get_weather(city='a]b')]", "I'll check [x] first.",
                   [("get_weather", {"city": "a]b"})]),
        "malformed": "[get_weather(city=__import__('os').getcwd())]",
    },
    "qwen3_coder": {
        "one": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>"
                "\n3\n</parameter>\n</function>\n</tool_call>", None,
                [("get_weather", {"city": "San Francisco", "days": 3})]),
        "several": ("<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n"
                    "</tool_call>", None, [("get_weather", {"city": "12"}), ("other", {"n": "5"})]),
        "before": ("Sure, one moment.\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
                   "</function>\n</tool_call>", "Sure, one moment.", [("get_weather", {"days": 2})]),
        "malformed": "<tool_call>\n<function=get_weather>\nno parameters here\n</function>\n</tool_call>",
    },
}
EARLY = {"hermes": "Let me look.", "llama3_json": "Here you go:", "mistral": "Checking the weather.",
         "pythonic": "I'll check [x] first.", "qwen3_coder": "Sure, one moment."}  # "before": the text before the call
GOOD = [(name, case) for name, cases in CASES.items() for case in cases if case != "malformed"]


def read(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_every_parser_has_cases():
    assert sorted(CASES) == sorted(PARSERS)


@pytest.mark.parametrize("name,case", GOOD)
def test_parse(name, case):
    text, content, calls = CASES[name][case]
    got_content, got = make_tool_parser(name).parse(text, SCHEMAS)
    assert got_content == content and read(got) == calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_is_content(name):
    text = CASES[name]["malformed"]
    assert make_tool_parser(name).parse(text, SCHEMAS) == (text, [])
    assert make_tool_parser(name).parse("No call here, just text.", SCHEMAS) == ("No call here, just text.", [])


def stream(name: str, text: str, size: int, fragments: list | None = None):
    """`text` fed in pieces of `size` characters: (the content sent before the end, the deltas put together
    as a client does: content, and each index's id, name and arguments). `fragments`: each delta sent
    before the end is appended to it."""
    s = ToolCallStream(make_tool_parser(name), SCHEMAS)
    early, deltas = "", []
    for i in range(0, len(text), size):
        content, more = s.feed(text[i:i + size])
        early += content
        deltas += more
    if fragments is not None:
        fragments += deltas
    rest, last = s.finish()
    calls: dict[int, dict] = {}
    for d in deltas + last:
        got = calls.setdefault(d.index, {"id": d.id, "type": d.type, "name": "", "arguments": ""})
        assert d.id is None or d.id == got["id"]  # the id comes once, with the name
        got["name"] += d.function.name or ""
        got["arguments"] += d.function.arguments
    return early, (early + rest) or None, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 17])
@pytest.mark.parametrize("name,case", GOOD + [(name, "malformed") for name in CASES])
def test_streamed_deltas_equal_the_whole_reading(name, case, size):
    text = CASES[name][case] if case == "malformed" else CASES[name][case][0]
    content, calls = make_tool_parser(name).parse(text, SCHEMAS)
    fragments: list = []
    early, got_content, got = stream(name, text, size, fragments)
    assert got_content == content
    if case == "malformed":  # content, as unstreamed; no call but what had gone out before it broke
        assert all(any(d.id == c["id"] for d in fragments) for c in got)
        return
    assert [(c["name"], c["arguments"]) for c in got] == [(c.name, c.arguments) for c in calls]
    assert all(c["id"] and c["type"] == "function" for c in got) and len({c["id"] for c in got}) == len(got)
    if case == "before":  # the content before the call went out before the end, the call's text did not
        assert early == EARLY[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_arguments_stream_in_fragments(name):
    """A call's first delta carries its id, type, name and the start of its arguments, the next ones pieces of
    the arguments, as they are generated (pythonic's calls each go out whole once its `)` has come)."""
    fragments: list = []
    stream(name, CASES[name]["several"][0], 3, fragments)
    if name == "pythonic":
        assert [(d.index, d.function.name) for d in fragments] == [(0, "a"), (1, "register_user")]
        return
    first = [d for d in fragments if d.index == 0]
    assert first[0].id and first[0].type == "function" and first[0].function.name
    assert len(first) >= 2 and all(d.id is None and d.function.name is None for d in first[1:])
    assert {d.index for d in fragments} == {0, 1, 2} if name != "qwen3_coder" else {0, 1}


@pytest.mark.parametrize("text", ['{"city": "San Francisco", "days": 3, "x": [1.50, true, null, {"a": "\\u00e9\\ud83d'
                                  '\\ude00\\n"}], "e": {}}', '{ "a" :1e5 , "b":[ ], "c": -0}', '[]', '"\\""'])
@pytest.mark.parametrize("ascii_only", [False, True])
def test_partial_json_is_a_start_of_the_whole(text, ascii_only):
    """Every start of a JSON text reads as a start of `json.dumps` of the whole value, growing with the text;
    the whole text as `json.dumps` itself."""
    whole, was = json.dumps(json.loads(text), ensure_ascii=ascii_only), ""
    for n in range(len(text) + 1):
        got, end = prefix(text[:n], 0, ascii_only)
        assert whole.startswith(got) and got.startswith(was) and (end is None) == (n < len(text))
        was = got
    assert was == whole
    with pytest.raises(ValueError):
        prefix('{"a": tru}', 0)


def test_mistral_ids_are_nine_letters_and_digits():
    _, _, calls = stream("mistral", CASES["mistral"]["several"][0], 5)
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


def test_stream_sends_content_without_a_call_as_it_comes():
    s = ToolCallStream(make_tool_parser("llama3_json"))
    assert s.feed("The set {1, 2} is ") == ("The set {1, 2} is", [])  # a brace that opens no call object
    assert s.feed("small. ") == (" small.", [])
    assert s.feed('{"na') == ("", [])  # may open a call: held
    assert s.finish() == (' {"na', [])  # it did not: content


def test_qwen3_coder_converts_by_the_schema():
    schema = {"type": "object", "properties": {
        "i": {"type": "integer"}, "f": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "a": {"type": "array"}, "s": {"type": "string"}, "n": {"type": ["integer", "null"]}, "bad": {"type": "integer"},
        "lit": {"type": "object"}}}
    params = {"i": "-4", "f": "2.5", "b": "True", "o": '{"k": [1]}', "a": "[1, 2]", "s": "007", "n": "null",
              "bad": "four", "lit": "{'k': None}", "free": "42"}
    text = "<tool_call>\n<function=t>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) \
        + "</function>\n</tool_call>"
    _, calls = make_tool_parser("qwen3_coder").parse(text, {"t": schema})
    assert read(calls) == [("t", {"i": -4, "f": 2.5, "b": True, "o": {"k": [1]}, "a": [1, 2], "s": "007", "n": None,
                                  "bad": "four", "lit": {"k": None}, "free": "42"})]
    _, calls = make_tool_parser("qwen3_coder").parse(text, None)  # no schema: every value a string
    assert read(calls)[0][1]["i"] == "-4"


@pytest.mark.parametrize("arg", ["__import__('os').getcwd()", "1 + 1", "open('x')", "{1, 2}", "b'x'",
                                 "float('nan')", "[x for x in 'ab']", "1e999", "{k: 1}"])
def test_pythonic_reads_literals_only(arg):
    text = f"[f(x={arg})]"
    assert make_tool_parser("pythonic").parse(text) == (text, [])


def test_bad_parser_name_names_the_choices(capsys):
    parse = add_server_args(argparse.ArgumentParser()).parse_args
    assert parse(["--tool-call-parser", "qwen3_coder"]).tool_call_parser == "qwen3_coder"
    with pytest.raises(SystemExit):
        parse(["--tool-call-parser", "granite"])
    err = capsys.readouterr().err
    assert "granite" in err and all(name in err for name in PARSERS)
    with pytest.raises(ValueError, match="choose one of hermes, llama3_json, mistral, pythonic, qwen3_coder"):
        make_tool_parser("granite")


@pytest.mark.parametrize("text,content", [
    ('\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.', "Done."),  # blank before: dropped
    ('  Hi <tool_call>{"name": "f", "arguments": {}}</tool_call> there ', "  Hi  there"),  # kept before text
])
def test_content_rule(text, content):
    """The content around calls: whitespace before the first call and at the end dropped, leading whitespace
    too when only whitespace comes before the call; streamed alike."""
    assert make_tool_parser("hermes").parse(text)[0] == content
    assert stream("hermes", text, 2)[1] == content


# a Hugging Face template's own tool-call turns (Qwen2.5's, shortened)
OWN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
                "{{ c.function.name }}:{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
                "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}")


PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"  # renders no tool_calls


@pytest.mark.parametrize("template", [OWN_TEMPLATE, PLAIN_TEMPLATE])
def test_earlier_tool_calls_go_to_a_template_that_renders_them(template):
    """An assistant turn's tool calls reach a template that renders `tool_calls` as such (arguments an object),
    which writes them its own way; a template that does not gets them as Hermes text in the content."""
    from jaxpaged.core.tokenizer import _compile_template
    from serve.protocol import AssistantTurn, ChatMessage, ToolResult
    convo = [ChatMessage(role="user", content="weather?"), AssistantTurn(role="assistant", tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "SF"}'}}]),
        ToolResult(role="tool", content="sunny", tool_call_id="call_1")]
    msgs, _ = tools.render_messages(convo, None, template)
    text = _compile_template(template).render(messages=msgs)
    if template == OWN_TEMPLATE:
        assert text == ('<|user|>weather?<|assistant|><tool_call>get_weather:{"city": "SF"}</tool_call>'
                        '<|tool|>sunny(call_1)')
    else:
        assert text == ('<|user|>weather?<|assistant|><tool_call>[{"name": "get_weather", "arguments": '
                        '{"city": "SF"}}]</tool_call><|tool|>sunny')
