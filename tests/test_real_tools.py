"""The demo pair (real Qwen2.5-Coder-0.5B-Instruct and the shipped drafter) behind the server: the openai client's
tools= gets parsed calls (required and named, streamed and not) and response_format's schema is met at T = 0 and
0.8. Marked slow; runs when the target is cached."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from service import ServerProcess

from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir

TARGET = demo_target_dir()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (TARGET / ".dspark-converted").is_file(),
                                                   reason=f"demo target not cached at {TARGET} (dspark-serve fetch)")]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "languages": {"type": "array", "maxItems": 4,
                                                         "items": {"type": "string", "maxLength": 20}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}


@pytest.fixture(scope="module")
def oai():
    srv = ServerProcess(TARGET, DEMO_DRAFTER, "--http-port", "0", "--served-model-name", "qwen",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--dtype", "float32",
                        timeout_s=600)
    yield openai.OpenAI(base_url=f"http://{srv.http_address}/v1", api_key="EMPTY", max_retries=0, timeout=300)
    srv.kill()


def _check_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    assert "paris" in args["city"].lower()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tools_get_a_parsed_call_streamed_and_not(oai, choice):
    """(With tool_choice "auto" this 0.5B model answers the call's JSON without the <tool_call> tags, so it stays
    content, as vLLM's hermes parser leaves it.)"""
    kw = dict(model="qwen", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0.0, max_tokens=96)
    resp = oai.chat.completions.create(**kw)
    (call,) = resp.choices[0].message.tool_calls
    _check_call(call)
    assert resp.choices[0].finish_reason == "tool_calls"
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == call.function.arguments  # greedy: the same call


def test_response_format_schema_is_met_at_t0_and_t08(oai):
    prompts = ["Describe a Python developer named Ana as JSON.", "Invent a person who knows Rust and Go."]
    for prompt in prompts:
        for t in (0.0, 0.8):
            resp = oai.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": prompt}], temperature=t, seed=1, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
            assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
            jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
