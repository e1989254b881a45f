"""An HTTP request's JSON body, read within its size limit and checked before any field is: UTF-8 JSON, an object,
nested at most MAX_DEPTH deep, and no text with a lone surrogate escape ("\\ud800") anywhere, keys included. Failures
are HTTP errors naming what is wrong. The checks scan the raw text first (linear, at regex speed) and walk the parsed
values only where the text shows a reason to."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # OpenAI's bodies nest 5 deep (tools' JSON schemas more); nothing here needs 64
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal
_BRACKET = re.compile(r"[\[\]{}]")
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # an escape of a UTF-16 surrogate (paired ones too)


class BodyError(Exception):
    """status 400 (bad body) or 413 (too large); `param` the field, when one is at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message, param)
        self.status, self.message, self.param = status, message, param


def parse_object(raw: bytes) -> dict:
    """The body as a dict (BodyError otherwise)."""
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte order mark, which JSON readers may ignore
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not UTF-8 (byte {e.start})") from None
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") \
            from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise BodyError(400, "the request body holds a number with too many digits") from None
    except RecursionError:  # kept out by the depth check; a last guard
        raise BodyError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise BodyError(400, f"the request body must be a JSON object, got {_kind(body)}")
    if _SURROGATE.search(text):
        check_text(body)
    return body


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def check_text(body: dict) -> None:
    """Every string and key is valid Unicode (a lone surrogate is not); iterative, whatever the depth."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else key
                _check(key, name)
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value) if isinstance(item, (str, dict, list)))


def _check(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(400, f"{_shown(path)} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at "
                             f"character {e.start}; text must be valid Unicode", _top(path)) from None


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(path: str) -> str:
    """A field's path for a message; a path holding a bad key names the field above it instead."""
    if _valid(path):
        return path
    top = _top(path)
    return f"a key in {top}" if top else "a key of the body"


def _top(path: str) -> str | None:
    name = path.split(".")[0].split("[")[0]
    return name if name and _valid(name) else None


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(type(value), "a number")
