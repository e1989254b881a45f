"""OpenAI's completion and chat-completion JSON to dspark.v1 requests and back, as pure functions; failures as
OpenAI's error object with its HTTP status."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from . import openai_tools
from .metrics import FINISH_NAMES

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
               "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
_ERROR_KIND = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
               404: ("invalid_request_error", "model_not_found"), 409: ("invalid_request_error", "conflict"),
               413: ("invalid_request_error", "request_too_large"), 429: ("rate_limit_error", "rate_limit_exceeded"),
               503: ("server_error", "service_unavailable"), 504: ("server_error", "timeout")}
# Sampling fields with the same name in OpenAI's (or vLLM's) JSON and in the proto, by JSON type
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("top_k", "seed", "min_tokens")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
_REFUSED = {"echo": "echo", "suffix": "suffix", "functions": "function calls (use tools)",
            "logit_bias": "logit_bias"}  # set (truthy), these would change what the answer means: refused


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
    tools: bool = False  # the answer is parsed for tool calls (hermes)


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"{name} must be {what}, got {type(value).__name__} {str(value)[:40]!r}", name)
    return value


def check_model(body: dict, served: str) -> None:
    model = _get(body, "model", (str,), "a string")
    if model is None:
        raise APIError(400, "model is required", "model")
    if model != served:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{served}`", "model")


def _sampling(body: dict, msg: pb.SamplingParams, chat: bool) -> Options:
    for name in _NUMBERS:
        if (v := _get(body, name, (int, float), "a number")) is not None:
            setattr(msg, name, v)
    for name in _INTS:
        if (v := _get(body, name, (int,), "an integer")) is not None:
            setattr(msg, name, 0 if name == "top_k" and v == -1 else v)  # vLLM's -1: off
    for name in _BOOLS:
        if (v := _get(body, name, (bool,), "true or false")) is not None:
            setattr(msg, name, v)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        if (v := _get(body, name, (int,), "an integer")) is not None:
            msg.max_tokens = v
            break
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise APIError(400, "stop must be a string or a list of strings", "stop")
        msg.stop.extend(stops)
    ids = _get(body, "stop_token_ids", (list,), "a list of integers")
    if ids is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "stop_token_ids must be a list of integers", "stop_token_ids")
        msg.stop_token_ids.extend(ids)
    if (n := _get(body, "n", (int,), "an integer")) is not None:
        msg.n = n
    top = _logprobs(body, chat)
    if top is not None:
        msg.logprobs = top
    stream = bool(_get(body, "stream", (bool,), "true or false"))
    opts = _get(body, "stream_options", (dict,), "an object") or {}
    return Options(chat, stream, stream and bool(opts.get("include_usage")), top)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: logprobs (bool) with top_logprobs (int); completions: logprobs (int, the alternatives)."""
    if not chat:
        return _get(body, "logprobs", (int,), "an integer")
    top = _get(body, "top_logprobs", (int,), "an integer")
    if not _get(body, "logprobs", (bool,), "true or false"):
        if top:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def _refuse_unsupported(body: dict) -> None:
    for name, what in _REFUSED.items():
        if body.get(name):
            raise APIError(400, f"{what} ({name}) is not supported by this server", name)
    best_of = body.get("best_of")
    if best_of not in (None, 1) and best_of != body.get("n"):
        raise APIError(400, "best_of other than n is not supported", "best_of")


def completion_request(body: dict) -> tuple[pb.GenerateRequest, Options]:
    """POST /v1/completions: one prompt, a string or token ids (a list of one of either is taken too)."""
    _refuse_unsupported(body)
    req = pb.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.token_ids.ids.extend(prompt)
    elif isinstance(prompt, list):
        raise APIError(400, "prompt must be one string or one list of token ids; send one request per prompt",
                       "prompt")
    else:
        raise APIError(400, "prompt is required: a string or a list of token ids", "prompt")
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        raise APIError(400, "tools are for /v1/chat/completions", "tools")
    return req, _build(req, body, chat=False)


def chat_request(body: dict) -> tuple[pb.GenerateRequest, Options]:
    """POST /v1/chat/completions: messages become the `chat` input, rendered by the server's chat template."""
    _refuse_unsupported(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content}", "messages")
    req = pb.GenerateRequest()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = req.chat.messages.add(role=role, content=_content(m.get("content"), i))
        _fields(openai_tools.set_message_tools, m, msg, i)
    add = _get(body, "add_generation_prompt", (bool,), "true or false")
    if add is not None:
        req.chat.add_generation_prompt = add
    opts = _build(req, body, chat=True)
    return req, replace(opts, tools=_fields(openai_tools.set_tools, body, req.chat))


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


def _build(req: pb.GenerateRequest, body: dict, chat: bool) -> Options:
    _fields(openai_tools.set_structured, body, req.sampling)
    try:
        return _sampling(body, req.sampling, chat)
    except (ValueError, TypeError) as e:  # out of the proto field's range (int32 and the like)
        raise APIError(400, f"a sampling field is out of range: {e}") from None


@dataclass
class Sequence:
    """One of the request's n sequences, as it streams in."""

    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    final: pb.GenerateComplete | None = None


Piece = Callable[[int], tuple[str, list[int]]]  # token id -> (its text, its bytes)


def finish_reason(final: pb.GenerateComplete) -> str:
    return FINISH_NAMES.get(final.finish_reason, "stop")


def spec_stats(finals: list[pb.GenerateComplete]) -> dict:
    """The speculative stats of a request: one sequence's, or the sum over its n."""
    steps = sum(f.stats.num_spec_steps for f in finals)
    drafted = sum(f.stats.num_draft_tokens for f in finals)
    accepted = sum(f.stats.num_accepted_tokens for f in finals)
    per_pos = [sum(p) for p in zip(*(f.stats.per_position_accepted for f in finals))] if finals else []
    out = {"tau": round((accepted + steps) / steps, 4) if steps else 0.0, "num_spec_steps": steps,
           "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
           "draft_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
           "per_position_accepted": per_pos}
    for name in ("draft_ms", "verify_ms", "transfer_ms", "queue_ms", "first_token_ms"):
        out[name] = round(sum(getattr(f.stats, name) for f in finals), 3)
    return out


def usage(finals: list[pb.GenerateComplete]) -> dict:
    prompt = finals[0].num_prompt_tokens if finals else 0
    completion = sum(len(f.output_ids) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def logprobs_json(entries: list[pb.TokenLogprob], piece: Piece, chat: bool, offset: int = 0) -> dict | None:
    """Chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: tokens, token_logprobs,
    top_logprobs and text_offset lists."""
    if chat:
        def item(tid: int, lp: float) -> dict:
            text, raw = piece(tid)
            return {"token": text, "logprob": lp, "bytes": raw}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob)
                                                                               for t in e.top]} for e in entries]}
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(piece(e.token_id)[0])
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece(t.token_id)[0]: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def response_json(rid: str, model: str, created: int, seqs: dict[int, Sequence], opts: Options,
                  piece: Piece) -> dict:
    """The whole answer of a request that was not streamed."""
    choices, finals = [], [seqs[i].final for i in sorted(seqs)]
    for i in sorted(seqs):
        s = seqs[i]
        lp = logprobs_json(s.logprobs, piece, opts.chat) if opts.top_logprobs is not None and s.logprobs else None
        choice = {"index": i, "logprobs": lp, "finish_reason": finish_reason(s.final)}
        if opts.chat:
            choice["message"], called = openai_tools.message(s.final.text, opts.tools)
            if called and choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = s.final.text
        choices.append(choice)
    return {"id": response_id(rid, opts), "object": "chat.completion" if opts.chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage(finals),
            "dspark": spec_stats(finals)}


def response_id(rid: str, opts: Options) -> str:
    return ("chatcmpl-" if opts.chat else "cmpl-") + rid


def chunk_json(rid: str, model: str, created: int, opts: Options, index: int, *, text: str | None = None,
               role: bool = False, logprobs: dict | None = None, final: pb.GenerateComplete | None = None,
               tool_calls: list[dict] | None = None, called: bool = False) -> dict:
    """One streamed chunk of one sequence: its first (chat: the role), a text delta and/or tool-call deltas, or
    its end (finish_reason, "tool_calls" when it `called` tools, and its speculative stats as `dspark`)."""
    choice: dict[str, Any] = {"index": index}
    if opts.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    reason = None if final is None else finish_reason(final)
    choice["finish_reason"] = "tool_calls" if called and reason == "stop" else reason
    out = {"id": response_id(rid, opts), "object": "chat.completion.chunk" if opts.chat else "text_completion",
           "created": created, "model": model, "choices": [choice]}
    if final is not None:
        out["dspark"] = spec_stats([final])
    return out


def usage_chunk_json(rid: str, model: str, created: int, opts: Options, finals: list[pb.GenerateComplete]) -> dict:
    """stream_options.include_usage: the last chunk, no choices, the usage and the request's stats."""
    return {"id": response_id(rid, opts), "object": "chat.completion.chunk" if opts.chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage(finals), "dspark": spec_stats(finals)}
