"""The request the gateway takes: what a client asked for, with named fields and unset kept apart from zero. Each edge
builds it from its own wire form (grpc_methods.py from dspark.v1.GenerateRequest, openai_convert.py from OpenAI's
JSON); the gateway checks its values (convert.py) and renders its chat (chat.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_serve.engine.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class Sampling:
    """SamplingParams' fields as the client sent them; None: unset (the server's default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None  # chat input: unset fills the context; 0 with prompt_logprobs: score only
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    n: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by token id
    structured_outputs: StructuredOutputsParams | None = None  # its shape is checked by the gateway


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str = ""
    tool_calls: tuple[dict, ...] = ()  # an assistant message's calls, as OpenAI's tool_calls entries
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


@dataclass(frozen=True)
class Chat:
    """A conversation for the chat template, with its tools and tool choice."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    tools: tuple[dict, ...] | None = None  # checked (tool_calls.check_tools); None: no tools
    tool_choice: str | None = None  # "auto", "none" or "required"; None: "auto" with tools, else "none"
    tool_choice_function: str | None = None  # one call of this function (overrides tool_choice)
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class Speculative:
    """Per-request overrides of the server's speculation."""

    num_speculative_tokens: int | None = None
    confidence_threshold: float | None = None
    disable: bool = False  # plain decoding


@dataclass(frozen=True)
class GatewayRequest:
    prompt: str | tuple[int, ...] | Chat | None  # text, token ids or a chat; None: the client sent none
    request_id: str = ""  # "": the gateway assigns one
    sampling: Sampling = field(default_factory=Sampling)
    speculative: Speculative = field(default_factory=Speculative)
