"""Hermes tool calls: parsing the whole output and as it streams (any split of the text gives the same calls and
content), the tool checks, and the forced choices' grammars and the flag "auto" needs."""

import json
import random

import pytest

from dspark_serve.cluster import chat, tool_calls
from dspark_serve.cluster.gateway_request import Chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop"}}]
TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')


def test_parse_whole_output():
    content, calls = tool_calls.parse(TEXT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("noop", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert tool_calls.parse("no calls here") == ("no calls here", [])
    assert tool_calls.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    content, calls = tool_calls.parse('<tool_call>{"name": "noop", "arguments": {"a": "\x1b"}}')  # unterminated
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": "\x1b"}


@pytest.mark.parametrize("seed", range(20))
def test_streamed_parse_equals_whole_parse_for_any_split(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 30)))
    parts = [TEXT[a:b] for a, b in zip([0] + cuts, cuts + [len(TEXT)])]
    stream, content, calls = tool_calls.ToolStream(), [], []
    for p in parts:
        text, done = stream.feed(p)
        content.append(text)
        calls += done
        assert "<" not in text or "<tool" not in text
    text, done = stream.finish()
    content.append(text)
    calls += done
    whole_content, whole_calls = tool_calls.parse(TEXT)
    assert "".join(content).strip() == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


def test_held_back_text_that_is_not_a_call_comes_out_at_the_end():
    stream = tool_calls.ToolStream()
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.finish() == ("<tool", [])


@pytest.mark.parametrize("tools, error", [
    ([], "tools must be a non-empty list"), ([{"type": "retrieval"}], 'tools[0].type must be "function"'),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters must be"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
])
def test_bad_tools_name_the_field(tools, error):
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        tool_calls.check_tools(tools)


def test_forced_choices_become_grammars_and_auto_needs_the_flag():
    c = Chat((), tools=tuple(tool_calls.check_tools(TOOLS)))
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        chat.tool_choice_grammar(c, auto_tool_choice=False)
    assert chat.tool_choice_grammar(c, auto_tool_choice=True) is None  # auto: free text or calls
    named = chat.tool_choice_grammar(Chat((), tools=c.tools, tool_choice_function="noop"), False)
    tag = json.loads(named.structural_tag)["format"]
    assert tag["type"] == "tag" and tag["begin"] == '<tool_call>\n{"name": "noop", "arguments": '
    assert tag["content"]["json_schema"] == {"type": "object", "properties": {}}
    required = chat.tool_choice_grammar(Chat((), tools=c.tools, tool_choice="required",
                                             parallel_tool_calls=False), False)
    fmt = json.loads(required.structural_tag)["format"]
    assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"] and fmt["stop_after_first"]
    assert [t["begin"].split('"')[3] for t in fmt["tags"]] == ["get_weather", "noop"]
    assert chat.tool_choice_grammar(Chat((), tools=c.tools, tool_choice="none"), False) is None
    with pytest.raises(ValueError, match="chat.tool_choice must be one of"):
        chat.tool_choice_grammar(Chat((), tools=c.tools, tool_choice="always"), True)
