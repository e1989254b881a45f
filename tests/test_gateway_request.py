"""The gateway's request from each edge, without a server: a dspark.v1.GenerateRequest with every field set arrives
whole, OpenAI's chat and completions bodies arrive as the same typed request, and both edges mean the same numbers."""

import dataclasses
import json

import pytest

from dspark_serve.cluster import convert
from dspark_serve.cluster.gateway import GatewayError
from dspark_serve.cluster.gateway_request import Chat, ChatMessage, GatewayRequest, Sampling, Speculative
from dspark_serve.cluster.grpc_methods import gateway_request
from dspark_serve.cluster.openai_convert import chat_request, completion_request
from dspark_serve.engine.structured_outputs import StructuredOutputsParams
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
SAMPLING = dict(temperature=0.5, top_p=0.75, top_k=7, min_p=0.125, seed=-3, max_tokens=9, ignore_eos=True,
                repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=2, logprobs=3,
                include_stop_str_in_output=True, skip_special_tokens=False, n=2, prompt_logprobs=1)
LIMIT = 1 << 20


def _full() -> pb.GenerateRequest:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi"),
                             pb.ChatMessage(role="assistant", content="", tool_calls_json=json.dumps(CALLS)),
                             pb.ChatMessage(role="tool", content="ok", tool_call_id="call_1", name="f")],
                   add_generation_prompt=False, tools_json=json.dumps(TOOLS), tool_choice="required",
                   tool_choice_function="f", parallel_tool_calls=False)
    sampling = pb.SamplingParams(**SAMPLING, stop=["a", "b"], stop_token_ids=[4, 5], logit_bias={9: -1.5, 3: 2.0},
                                 structured_outputs=pb.StructuredOutputs(choice=pb.Choices(values=["x", "y"]),
                                                                         disable_any_whitespace=True))
    spec = pb.SpeculativeOverrides(num_speculative_tokens=3, confidence_threshold=0.25, disable=True)
    return pb.GenerateRequest(request_id="r1", chat=chat, sampling=sampling, speculative=spec)


def test_every_grpc_field_arrives():
    msg = _full()
    for part in (msg.sampling, msg.chat, msg.speculative, msg):  # the message really sets every field
        assert len(part.ListFields()) == len(part.DESCRIPTOR.fields) - (2 if part is msg else 0)  # one input of 3
    req = gateway_request(msg, LIMIT)
    assert req.request_id == "r1"
    assert req.sampling == Sampling(**SAMPLING, stop=("a", "b"), stop_token_ids=(4, 5),
                                    logit_bias=((3, 2.0), (9, -1.5)), structured_outputs=StructuredOutputsParams(
                                        choice=("x", "y"), disable_any_whitespace=True))
    assert req.prompt == Chat((ChatMessage("user", "hi"), ChatMessage("assistant", "", tuple(CALLS)),
                               ChatMessage("tool", "ok", (), "call_1", "f")),
                              add_generation_prompt=False, tools=tuple(TOOLS), tool_choice="required",
                              tool_choice_function="f", parallel_tool_calls=False)
    assert req.speculative == Speculative(3, 0.25, True)
    unset = gateway_request(pb.GenerateRequest(text="hey"), LIMIT)
    assert unset == GatewayRequest("hey")
    assert gateway_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), LIMIT).prompt == (1, 2)
    assert gateway_request(pb.GenerateRequest(), LIMIT).prompt is None
    assert gateway_request(pb.GenerateRequest(chat=pb.Chat()), LIMIT).prompt == Chat(())


@pytest.mark.parametrize("change, words", [
    (lambda m: setattr(m.chat, "tools_json", "[oops"), "chat.tools_json is not valid JSON"),
    (lambda m: setattr(m.chat, "tools_json", "{}"), "chat.tools must be a non-empty list"),
    (lambda m: setattr(m.chat.messages[1], "tool_calls_json", "{}"), "chat.messages[1].tool_calls_json must be"),
    (lambda m: m.sampling.structured_outputs.ClearField("choice"), "sampling.structured_outputs sets no kind"),
    (lambda m: setattr(m, "request_id", "r" * LIMIT), f"bytes; the limit is {LIMIT}"),
])
def test_what_has_no_typed_form_is_invalid_argument(change, words):
    msg = _full()
    change(msg)
    with pytest.raises(GatewayError) as e:
        gateway_request(msg, LIMIT)
    assert e.value.code == "INVALID_ARGUMENT" and words in e.value.message


def test_openai_chat_body():
    body = {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                       {"role": "assistant", "content": None, "tool_calls": CALLS},
                                       {"role": "tool", "content": "ok", "tool_call_id": "call_1"}],
            "max_completion_tokens": 5, "temperature": 0.5, "top_k": -1, "seed": 7, "stop": "x", "n": 2,
            "logprobs": True, "top_logprobs": 2, "logit_bias": {"12": 5}, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "response_format": {"type": "json_object"}, "add_generation_prompt": False,
            "stream": True, "stream_options": {"include_usage": True}}
    req, opts = chat_request(body, vocab_size=512)
    assert req.request_id == "" and req.speculative == Speculative()
    assert req.prompt == Chat((ChatMessage("system", "be brief"), ChatMessage("assistant", "", tuple(CALLS)),
                               ChatMessage("tool", "ok", tool_call_id="call_1")), add_generation_prompt=False,
                              tools=tuple(TOOLS), tool_choice="required", parallel_tool_calls=False)
    assert req.sampling == Sampling(temperature=0.5, top_k=0, seed=7, max_tokens=5, stop=("x",), n=2, logprobs=2,
                                    logit_bias=((12, 5.0),), structured_outputs=StructuredOutputsParams(
                                        json_object=True))
    assert (opts.chat, opts.stream, opts.include_usage, opts.top_logprobs, opts.n, opts.tools) == (
        True, True, True, 2, 2, True)


def test_openai_completions_body():
    body = {"model": "m", "prompt": [[3], [1, 2]], "max_tokens": 0, "echo": True, "logprobs": 2, "min_p": 0.1,
            "stop_token_ids": [7], "ignore_eos": True, "structured_outputs": {"regex": "a+"}}
    reqs, opts = completion_request(body, vocab_size=512, max_seqs=8)
    rid = reqs[0].request_id.rsplit("-", 1)[0]
    assert [(r.request_id, r.prompt) for r in reqs] == [(f"{rid}-0", (3,)), (f"{rid}-1", (1, 2))]
    assert reqs[0].sampling == reqs[1].sampling == Sampling(
        min_p=0.1, max_tokens=0, ignore_eos=True, logprobs=2, prompt_logprobs=2, stop_token_ids=(7,),
        structured_outputs=StructuredOutputsParams(regex="a+"))
    assert opts.echo and opts.top_logprobs == 2 and not opts.chat and opts.n == 1
    (text,), _ = completion_request({"model": "m", "prompt": "ab"}, vocab_size=512, max_seqs=8)
    assert text == GatewayRequest("ab", text.request_id) and len(text.request_id) == 32


def test_both_edges_give_the_step_loop_the_same_params():
    """dspark.v1 carries sampling numbers as float32; the gateway holds JSON's at the same precision."""
    numbers = dict(temperature=0.7, top_p=0.9, min_p=0.05, presence_penalty=0.3, frequency_penalty=-0.1,
                   repetition_penalty=1.1)
    grpc_req = gateway_request(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(
        **numbers, logit_bias={5: 0.1})), LIMIT)
    (http_req,), _ = completion_request({"model": "m", "prompt": [1], **numbers, "logit_bias": {"5": 0.1}}, 512, 8)
    assert grpc_req.sampling != http_req.sampling  # float32 against float64 ...
    params = [convert.sampling_params(r.sampling, 256) for r in (grpc_req, http_req)]
    assert params[0] == params[1] and params[0]["temperature"] == convert.float32(0.7)  # ... the same to the engine
    huge = dataclasses.replace(http_req.sampling, temperature=1e300)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        convert.sampling_params(huge, 256)
