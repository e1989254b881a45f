"""Tool calls in the hermes style Qwen2.5 and Qwen3 are trained on (`<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`): OpenAI tool definitions checked, `required` and named tool choices as xgrammar structural tags (the
arguments valid for the function's parameters), and the model's output parsed into OpenAI tool_calls, whole or as
it streams. Pure functions."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes",)  # --tool-call-parser
BEGIN, END = "<tool_call>", "</tool_call>"
MAX_WHITESPACE = 20  # consecutive whitespace characters in the arguments at most
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
MAX_TOOLS = 128


def check_tools(tools: Any, prefix: str = "tools") -> list[dict]:
    """OpenAI's tools list -> the same list with each function's parameters set (an empty object schema when
    absent). ValueError naming the field (prefix[i].function.name, ...)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{prefix} must be a non-empty list of {{type: function, function: {{name, ...}}}}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{prefix} has {len(tools)} tools; the limit is {MAX_TOOLS}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"{prefix}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}.type must be \"function\"")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.function.name must be 1-64 letters, digits, _, . or -, got {name!r}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is defined twice")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object, got "
                             f"{type(params).__name__}")
        if params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must describe an object (type \"object\"), got type "
                             f"{params.get('type')!r}")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def _tag(fn: dict) -> dict:
    return {"type": "tag", "begin": f'{BEGIN}\n{{"name": "{fn["name"]}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": fn["parameters"], "max_whitespace_cnt": MAX_WHITESPACE},
            "end": f"}}\n{END}"}


def choice_grammar(tools: list[dict], choice: str, function: str | None, parallel: bool = True,
                   prefix: str = "tool_choice") -> str | None:
    """The structural tag (JSON text) a tool choice enforces, or None for "auto" / "none". `function` names the
    one function to call (a named choice); "required": one or more calls (one when not `parallel`)."""
    fns = {t["function"]["name"]: t["function"] for t in tools}
    if function:
        if function not in fns:
            raise ValueError(f"{prefix} names function {function!r}, which is not in tools ({', '.join(fns)})")
        fmt: dict = _tag(fns[function])
    elif choice == "required":
        fmt = {"type": "tags_with_separator", "tags": [_tag(f) for f in fns.values()], "separator": "\n",
               "at_least_one": True, "stop_after_first": not parallel}
    else:
        return None
    return json.dumps({"type": "structural_tag", "format": fmt})


def chat_messages_for_template(tool_calls: list[dict]) -> list[dict]:
    """An assistant message's OpenAI tool_calls as chat templates read them: arguments as an object (transformers'
    and vLLM's convention), not JSON text."""
    out = []
    for call in tool_calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # the template gets the text as it is
        out.append({**call, "function": fn})
    return out


def new_call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + secrets.token_hex(12), "type": "function", "function": {"name": name, "arguments": args}}


def _parse_call(body: str) -> dict | None:
    """One call's JSON; raw control characters in its strings are taken (the arguments are written anew)."""
    try:
        obj = json.loads(body.strip(), strict=False)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return new_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def parse(text: str) -> tuple[str | None, list[dict]]:
    """The whole output -> (content before the first call, or None when empty; the calls). When a call's JSON does
    not parse, the text is all content (as vLLM's hermes parser does)."""
    if BEGIN not in text:
        return text, []
    calls = []
    for m in _CALL.finditer(text):
        call = _parse_call(m.group(1) if m.group(1) is not None else m.group(2))
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index(BEGIN)].strip()
    return content or None, calls


@dataclass
class ToolStream:
    """Parses the output as it streams: `feed` -> content text safe to send (a possible start of <tool_call> is
    held back) and the calls completed in this delta; `finish` ends it."""

    buffer: str = ""
    inside: bool = False
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        content, done = [], []
        while True:
            if not self.inside:
                i = self.buffer.find(BEGIN)
                if i < 0:
                    keep = _partial_suffix(self.buffer, BEGIN)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:i])
                self.buffer, self.inside = self.buffer[i + len(BEGIN):], True
            j = self.buffer.find(END)
            if j < 0:
                break
            call = _parse_call(self.buffer[:j])
            if call is not None:
                done.append(call)
            else:  # not a call after all: its text is content
                content.append(BEGIN + self.buffer[:j + len(END)])
            self.buffer, self.inside = self.buffer[j + len(END):], False
        self.calls += done
        text = "".join(content)
        if self.calls and not text.strip():
            text = ""
        return text, done

    def finish(self) -> tuple[str, list[dict]]:
        """What is left: an unterminated call (parsed if its JSON is whole) or held-back text."""
        rest, self.buffer = self.buffer, ""
        if self.inside:
            self.inside = False
            call = _parse_call(rest)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return BEGIN + rest, []
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that begins tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
