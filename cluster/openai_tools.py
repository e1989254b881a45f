"""OpenAI's structured-output and tool fields as the gateway request's (response_format, vLLM's structured_outputs
and guided_* extras, tools, tool_choice, parallel_tool_calls), and tool calls back into OpenAI's answers. Pure."""

from __future__ import annotations

import json
from typing import Any

from dspark_serve.engine.structured_outputs import StructuredOutputsParams

from . import tool_calls

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class FieldError(ValueError):
    """A bad field: `param` names it for OpenAI's error object."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                         '"json_schema", "json_schema": {"name": ..., "schema": {...}}}', "response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = fmt.get("json_schema")
    schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise FieldError("response_format.json_schema.schema must be a JSON schema object", "response_format")
    so = StructuredOutputsParams(json=json.dumps(schema))
    so.validate("response_format.json_schema.schema")
    return so


def structured(body: dict) -> StructuredOutputsParams | None:
    """What the output must match: response_format, structured_outputs or vLLM's older guided_* fields (one of
    them). FieldError naming the field."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if body.get("response_format") is not None:
        so = _response_format(body["response_format"])
        if so is not None:
            found.append(("response_format", so))
    if body.get("structured_outputs") is not None:
        try:
            found.append(("structured_outputs", StructuredOutputsParams.from_dict(body["structured_outputs"])))
        except ValueError as e:
            raise FieldError(str(e), "structured_outputs") from None
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            try:
                found.append((name, StructuredOutputsParams.from_dict({kind: body[name]}, name)))
            except ValueError as e:
                raise FieldError(str(e).replace(f"{name}.{kind}", name), name) from None
    if len(found) > 1:
        raise FieldError(f"{found[0][0]} and {found[1][0]} both constrain the output; send one", found[1][0])
    return found[0][1] if found else None


def chat_tools(body: dict) -> tuple[dict, bool]:
    """tools, tool_choice and parallel_tool_calls as the chat input's fields (gateway_request.Chat's), and whether
    the answer is parsed for calls (tools given and tool_choice not "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise FieldError("tool_choice needs tools: there are no tools to call", "tool_choice")
        return {}, False
    try:
        checked = tool_calls.check_tools(tools)
    except ValueError as e:
        raise FieldError(str(e), "tools") from None
    out: dict[str, Any] = {"tools": tuple(checked)}
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise FieldError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                             '{"name": ...}}', "tool_choice")
        if name not in {t["function"]["name"] for t in checked}:
            raise FieldError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        out["tool_choice_function"] = name
    elif choice is not None:
        if choice not in ("auto", "none", "required"):
            raise FieldError(f'tool_choice must be "auto", "none", "required" or a named function, got {choice!r}',
                             "tool_choice")
        out["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise FieldError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        out["parallel_tool_calls"] = parallel
    return out, choice != "none"


def message_tools(m: dict, i: int) -> dict:
    """An assistant message's tool_calls, a tool message's tool_call_id and name, as gateway_request.ChatMessage's
    fields."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise FieldError(f"messages[{i}].tool_calls must be a list of tool calls", "messages")
        out["tool_calls"] = tuple(calls)
    for name in ("tool_call_id", "name"):
        if m.get(name) is not None:
            if not isinstance(m[name], str):
                raise FieldError(f"messages[{i}].{name} must be a string", "messages")
            out[name] = m[name]
    return out


def message(text: str, parse: bool) -> tuple[dict, bool]:
    """The answer's message and whether it called tools."""
    if not parse:
        return {"role": "assistant", "content": text}, False
    content, calls = tool_calls.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": calls}, True


def call_deltas(calls: list[dict], first_index: int) -> list[dict]:
    """OpenAI's streamed tool_calls entries: each call whole, by its index among the sequence's calls."""
    return [{"index": first_index + k, **c} for k, c in enumerate(calls)]
