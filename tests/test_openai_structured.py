"""Structured outputs and tool calls through a real server (tiny pair, byte-level tokenizer, a chat template that
renders tools): the official openai client's response_format, vLLM's structured_outputs extra, tools with forced
choices (parsed calls, streamed as tool-call deltas), gRPC's structured_outputs, LangChain's bind_tools, and 400s
naming the field."""

import json
import re

import jsonschema
import openai
import pytest
from byte_tokenizer import byte_tokenizer
from service import ServerProcess

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

MODEL = "tiny-tools"
EOS = 511  # <|special_1|>: the end of a turn
TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}{% endif %}<|special_1|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 50}},
          "required": ["ok", "n"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    target, draft = random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)
    byte_tokenizer(512, specials=2).save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return target, draft


@pytest.fixture(scope="module")
def server(pair_dirs):
    srv = ServerProcess(*pair_dirs, "--http-port", "0", "--served-model-name", MODEL, "--max-model-len", "4096",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"http://{server.http_address}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_response_format_json_schema_streamed_and_not(oai, temperature):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=600, temperature=temperature, seed=3,  # whitespace: <= 20 a gap
              response_format=_schema_format(SCHEMA))
    resp = oai.chat.completions.create(**kw)
    text = resp.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert resp.choices[0].finish_reason == "stop" and resp.to_dict()["dspark"]["num_spec_steps"] >= 1
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # seeded: the same


def test_structured_outputs_extra_on_completions_and_chat(oai):
    cases = [({"regex": "[a-c]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{2,4}-[0-9]{2}", t)),
             ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
             ({"grammar": 'root ::= "(" [0-9] [0-9]? ("+" [0-9])? ")"'},
              lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9])?\)", t)),
             ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)
              is None and ": " not in t.replace('": ', "")),
             ({"json_object": True}, lambda t: t.startswith("{"))]
    for so, valid in cases:
        for t in (0.0, 0.8):
            c = oai.completions.create(model=MODEL, prompt="say:", max_tokens=40, temperature=t, seed=1,
                                       extra_body={"structured_outputs": so})
            if "json_object" not in so:
                assert valid(c.choices[0].text) and c.choices[0].finish_reason == "stop", (so, c.choices[0].text)
            else:
                assert valid(c.choices[0].text), c.choices[0].text
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0.0,
                                       extra_body={"guided_choice": ["red", "blue"]})  # vLLM's older name
    assert chat.choices[0].message.content in ("red", "blue")


def test_named_tool_choice_gets_a_parsed_call_streamed_and_not(oai):
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=600, temperature=0.8, seed=5,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    resp = oai.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", call.function.arguments)]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_calls_listed_functions_with_valid_arguments(oai, parallel):
    for seed in range(3):
        resp = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=600, temperature=0.8, seed=seed)
        calls = resp.choices[0].message.tool_calls
        assert calls and (parallel or len(calls) == 1), resp
        for call in calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tools_render_through_the_template_with_earlier_calls(oai, pair_dirs):
    """A second turn: the assistant's call and the tool's answer are rendered as transformers renders them."""
    from transformers import PreTrainedTokenizerFast

    history = CHAT + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    resp = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0.0)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(pair_dirs[0] / "tokenizer.json"))
    tok.chat_template = TEMPLATE
    hf_history = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if "tool_calls" in m else m for m in history]
    ids = tok.apply_chat_template(hf_history, tools=TOOLS, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].message.tool_calls is None  # tool_choice "none": not parsed


def test_grpc_structured_outputs(server):
    c = DSparkClient(server.address)
    try:
        so = pb.StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True)
        out = c.generate([5, 80, 300], max_tokens=40, temperature=0.0, structured_outputs=so)
        jsonschema.validate(json.loads(c_text := out["text"]), SCHEMA)
        assert out["finish_reason"] == "stop", c_text
        bad = pb.StructuredOutputs(regex="(ab")
        with pytest.raises(Exception) as e:
            c.generate([5], max_tokens=4, structured_outputs=bad)
        assert "INVALID_ARGUMENT" in str(e.value) and "structured_outputs.regex does not compile" in str(e.value)
        with pytest.raises(Exception, match="sampling.structured_outputs sets no kind"):
            c.generate([5], max_tokens=4, structured_outputs=pb.StructuredOutputs(disable_any_whitespace=True))
    finally:
        c.close()


@pytest.mark.parametrize("kw, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     None, "structured_outputs.json does not compile"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format",
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "xml"}), "response_format", "response_format must be"),
    (dict(extra_body={"structured_outputs": {"lark": "start: x"}}), "structured_outputs",
     "structured_outputs.lark is not a structured output kind"),
    (dict(extra_body={"structured_outputs": {"regex": "[a"}}), None, "structured_outputs.regex does not compile"),
    (dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs", "structured_outputs.choice"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
     "structured_outputs", "both constrain"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools", "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), "tools",
     "tools[0].function.parameters must describe an object"),
    (dict(tools=TOOLS + [TOOLS[0]]), "tools", "tools[2].function.name 'get_weather' is defined twice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "tool_choice names function 'nope'"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
    (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}], tool_choice="required"), None, "does not compile"),
])
def test_bad_specs_are_400s_naming_the_field(oai, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **kw)
    assert words in e.value.message, e.value.message
    if param is not None:
        assert e.value.body["param"] == param


def test_auto_tool_choice_with_the_flag_answers_text_or_calls(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=16, temperature=0.0)
    msg = resp.choices[0].message
    assert msg.content or msg.tool_calls  # the tiny model writes text; parsing is tests/test_tool_calls.py's


def test_langchain_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessageChunk

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"http://{server.http_address}/v1", api_key="EMPTY",
                                      temperature=0.0, max_tokens=600, max_retries=0)
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    msg = bound.invoke("weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)
    streamed = None
    for chunk in bound.stream("weather in Oslo?"):
        assert isinstance(chunk, AIMessageChunk)
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


def test_a_schema_that_compiles_slowly_stalls_no_other_stream(oai):
    """A 3000-property schema compiles for seconds in a worker thread; a plain stream started meanwhile finishes
    first, at its usual pace."""
    import threading
    import time

    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{%d,%d}x" % (i % 5, i % 5 + 3)}
                                            for i in range(3000)}}
    done = {}

    def slow():
        done["slow"] = oai.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0.0,
                                              extra_body={"structured_outputs": {"json": big}})
        done["slow_at"] = time.monotonic()

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    start = time.monotonic()
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=32, temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    took = time.monotonic() - start
    assert text and took < 1.5 and "slow" not in done, took
    t.join(120)
    assert done["slow"].choices[0].text.startswith("{") and done["slow_at"] - start > took
