"""OpenAI's completion and chat-completion JSON to the gateway's requests, as pure functions: each field checked by
type and range (dspark.v1's too: ids fit int32, seeds int64), failures as OpenAI's error object with its HTTP status.
openai_answer.py goes back."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dspark_serve.engine.sampling_params import MAX_BIAS, MAX_LOGIT_BIAS

from . import openai_tools
from .gateway_request import Chat, ChatMessage, GatewayRequest, Sampling

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
               "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
_ERROR_KIND = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
               404: ("invalid_request_error", "model_not_found"), 405: ("invalid_request_error", "method_not_allowed"),
               408: ("invalid_request_error", "request_timeout"), 409: ("invalid_request_error", "conflict"),
               413: ("invalid_request_error", "request_too_large"),
               431: ("invalid_request_error", "request_header_fields_too_large"),
               429: ("rate_limit_error", "rate_limit_exceeded"), 503: ("server_error", "service_unavailable"),
               504: ("server_error", "timeout")}
# Sampling fields with the same name in OpenAI's (or vLLM's) JSON and in the gateway request, by JSON type
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = {"top_k": 32, "seed": 64, "min_tokens": 32}  # bits of dspark.v1's signed field
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
_REFUSED = {"suffix": "suffix", "functions": "function calls (use tools)"}  # would change the answer
TOKEN_ID_LIMIT = 1 << 31  # token ids travel as int32


class APIError(Exception):
    """An HTTP failure as OpenAI reports it."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message, param)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind, code = _ERROR_KIND.get(self.status, ("server_error", "internal_error"))
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}


def from_status(code: str, message: str) -> APIError:
    """A GatewayError's gRPC code name as an HTTP error."""
    return APIError(HTTP_STATUS.get(code, 500), message)


@dataclass(frozen=True)
class Options:
    """What shapes the answer rather than the generation."""

    chat: bool
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs in the answer
    echo: bool = False  # completions: each choice's text (and logprobs) start with its prompt's
    prompt_logprobs: int | None = None  # vLLM's extra: the prompt's logprobs in the answer
    n: int = 1  # sequences per prompt: choice index = prompt * n + sequence
    tools: bool = False  # the answer is parsed for tool calls (hermes)


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"{name} must be {what}, got {_shown(value)}", name)
    return value


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {str(value)[:40]!r}"


def _int(body: dict, name: str, bits: int = 32, low: int | None = None) -> int | None:
    """An integer field that fits dspark.v1's signed `bits`-bit field (and is >= low)."""
    value = _get(body, name, (int,), "an integer")
    lo, hi = -(1 << (bits - 1)) if low is None else low, (1 << (bits - 1)) - 1
    if value is not None and not lo <= value <= hi:
        raise APIError(400, f"{name} must be an integer in [{lo}, {hi}], got {str(value)[:40]}", name)
    return value


def _number(body: dict, name: str) -> float | None:
    value = _get(body, name, (int, float), "a number")
    try:
        return None if value is None else float(value)
    except OverflowError:  # an integer past float's range
        raise APIError(400, f"{name} must be a finite number, got an integer of {len(str(value))} digits",
                       name) from None


def check_model(body: dict, served: str) -> None:
    model = _get(body, "model", (str,), "a string")
    if model is None:
        raise APIError(400, "model is required", "model")
    if model != served:
        raise APIError(404, f"The model `{model[:200]}` does not exist; this server serves `{served}`", "model")


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    limit = min(vocab_size, TOKEN_ID_LIMIT)
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limit:
            raise APIError(400, f"{name}[{i}] must be a token id in [0, {limit}), got {_shown(t)}", name.split("[")[0])
    return value


def _sampling(body: dict, chat: bool, vocab_size: int) -> tuple[Sampling, Options]:
    kw: dict[str, Any] = {"structured_outputs": _fields(openai_tools.structured, body)}
    for name in _NUMBERS:
        kw[name] = _number(body, name)
    for name, bits in _INTS.items():
        if (v := _int(body, name, bits)) is not None:
            kw[name] = 0 if name == "top_k" and v == -1 else v  # vLLM's -1: off
    for name in _BOOLS:
        kw[name] = _get(body, name, (bool,), "true or false")
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        if (v := _int(body, name)) is not None:
            kw["max_tokens"] = v
            break
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise APIError(400, "stop must be a string or a list of strings", "stop")
        kw["stop"] = tuple(stops)
    if (ids := _get(body, "stop_token_ids", (list,), "a list of integers")) is not None:
        kw["stop_token_ids"] = tuple(_token_ids(ids, "stop_token_ids", TOKEN_ID_LIMIT))
    kw["n"] = _int(body, "n", low=1)
    if (bias := _get(body, "logit_bias", (dict,), "an object of token id: bias")) is not None:
        kw["logit_bias"] = tuple(sorted(_logit_bias(bias, vocab_size).items()))
    top = kw["logprobs"] = _logprobs(body, chat)
    echo = not chat and bool(_get(body, "echo", (bool,), "true or false"))
    prompt_top = _int(body, "prompt_logprobs", low=0)
    if echo and top is not None:  # the prompt's tokens with their logprobs, as many alternatives as the output's
        prompt_top = max(top, prompt_top or 0)
    kw["prompt_logprobs"] = prompt_top
    if kw.get("max_tokens") == 0:
        if not echo and prompt_top is None:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo or prompt_logprobs)", "max_tokens")
        kw["prompt_logprobs"] = prompt_top or 0
    stream = bool(_get(body, "stream", (bool,), "true or false"))
    opts = _get(body, "stream_options", (dict,), "an object") or {}
    return Sampling(**kw), Options(chat, stream, stream and bool(opts.get("include_usage")), top, echo,
                                   _int(body, "prompt_logprobs", low=0), kw["n"] or 1)


def _logit_bias(bias: dict, vocab_size: int) -> dict[int, float]:
    """{"token id": bias}: ids in the vocabulary, biases in [-100, 100], as OpenAI's."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}", "logit_bias")
    out = {}
    for key, value in bias.items():
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= tid < min(vocab_size, TOKEN_ID_LIMIT):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key[:40]!r}",
                           "logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise APIError(400, f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got "
                                f"{_shown(value)} for {key}", "logit_bias")
        out[tid] = float(value)
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: logprobs (bool) with top_logprobs (int); completions: logprobs (int, the alternatives)."""
    if not chat:
        return _int(body, "logprobs", low=0)
    top = _int(body, "top_logprobs", low=0)
    if not _get(body, "logprobs", (bool,), "true or false"):
        if top:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _refuse_unsupported(body: dict, chat: bool) -> None:
    refused = {**_REFUSED, "echo": "echo"} if chat else _REFUSED
    for name, what in refused.items():
        if body.get(name):
            raise APIError(400, f"{what} ({name}) is not supported by this server", name)
    best_of = body.get("best_of")
    if best_of not in (None, 1) and best_of != body.get("n"):
        raise APIError(400, "best_of other than n is not supported", "best_of")


def completion_request(body: dict, vocab_size: int, max_seqs: int) -> tuple[list[GatewayRequest], Options]:
    """POST /v1/completions: one request per prompt (a string, token ids, or a list of either), ids
    "<id>-<prompt>" when there are several; at most max_seqs sequences (prompts x n)."""
    _refuse_unsupported(body, chat=False)
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        raise APIError(400, "tools are for /v1/chat/completions", "tools")
    prompts = _prompts(body.get("prompt"), vocab_size)
    sampling, opts = _sampling(body, False, vocab_size)
    if len(prompts) * opts.n > max_seqs:
        raise APIError(400, f"{len(prompts)} prompts x n = {opts.n} is {len(prompts) * opts.n} sequences; the limit "
                            f"is {max_seqs}", "prompt")
    rid = secrets.token_hex(16)
    return [GatewayRequest(p if isinstance(p, str) else tuple(p), rid if len(prompts) == 1 else f"{rid}-{i}", sampling)
            for i, p in enumerate(prompts)], opts


def _prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """OpenAI's four prompt shapes as a list of prompts."""
    shape = "a string, a list of token ids, or a list of either"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, f"prompt is required: {shape}" if not prompt else f"prompt must be {shape}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return prompt
    if all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p:
                raise APIError(400, f"prompt[{i}] is empty", "prompt")
            _token_ids(p, f"prompt[{i}]", vocab_size)
        return prompt
    if any(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, f"prompt must be {shape}, not a mix", "prompt")
    return [_token_ids(prompt, "prompt", vocab_size)]


def chat_request(body: dict, vocab_size: int) -> tuple[GatewayRequest, Options]:
    """POST /v1/chat/completions: messages become the `chat` input, rendered by the server's chat template."""
    _refuse_unsupported(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content}", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        turns.append(ChatMessage(role, _content(m.get("content"), i), **_fields(openai_tools.message_tools, m, i)))
    add = _get(body, "add_generation_prompt", (bool,), "true or false")
    sampling, opts = _sampling(body, True, vocab_size)
    tools, parse = _fields(openai_tools.chat_tools, body)
    chat = Chat(tuple(turns), True if add is None else add, **tools)
    return GatewayRequest(chat, "", sampling), replace(opts, tools=parse)


def _fields(fn: Callable, *args: Any) -> Any:
    """fn(*args), its FieldError as an HTTP 400 naming the field."""
    try:
        return fn(*args)
    except openai_tools.FieldError as e:
        raise APIError(400, str(e), e.param) from None


def _content(content: Any, i: int) -> str:
    """A string, or text parts (joined by newlines, as vLLM does); null is empty."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
