"""StructuredOutputsParams: what a request's output must match (vLLM's structured_outputs: a JSON schema, any JSON
object, a regex, a choice of strings, an EBNF grammar or an xgrammar structural tag), checked once at the boundary.
No torch and no xgrammar: the gateway uses it too."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the kinds is set. `json` is a JSON schema as JSON text (`from_dict` takes a dict too)."""

    json: str | None = None
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is one of these strings
    grammar: str | None = None  # EBNF (GBNF) with a `root` rule
    structural_tag: str | None = None  # an xgrammar structural tag as JSON text (tool calls are built as one)
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond what the compact form has

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What a compiled grammar is cached by."""
        return self.kind, getattr(self, self.kind), self.disable_any_whitespace

    def validate(self, prefix: str = "structured_outputs") -> None:
        """ValueError naming the field (`prefix`.kind) when the shape is wrong; what the grammar engine refuses
        (a schema it cannot compile, a bad regex) is named where it is compiled."""
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"{prefix} must set exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(kinds) if kinds else 'none'}")
        kind = kinds[0]
        value = getattr(self, kind)
        field = f"{prefix}.{kind}"
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"{field} must be true, got {value!r}")
        elif kind == "choice":
            if not isinstance(value, tuple) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"{field} must be a non-empty list of non-empty strings, got {_short(value)}")
            if sum(map(len, value)) > MAX_SPEC_CHARS:
                raise ValueError(f"{field} is over {MAX_SPEC_CHARS} characters")
        else:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{field} must be a non-empty string, got {_short(value)}")
            if len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"{field} is {len(value)} characters; the limit is {MAX_SPEC_CHARS}")
            if kind in ("json", "structural_tag"):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"{field} is not valid JSON: {e}") from None
                if not isinstance(parsed, dict) and not (kind == "json" and isinstance(parsed, bool)):
                    raise ValueError(f"{field} must be a JSON object, got {type(parsed).__name__}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"{prefix}.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}")

    @classmethod
    def from_dict(cls, body: Any, prefix: str = "structured_outputs") -> StructuredOutputsParams:
        """vLLM's structured_outputs object ({"json": schema or text, "regex": ..., "choice": [...], "grammar": ...,
        "json_object": true, "structural_tag": ...}); ValueError naming an unknown or bad field."""
        if not isinstance(body, dict):
            raise ValueError(f"{prefix} must be an object, got {_short(body)}")
        known = set(KINDS) | {"disable_any_whitespace"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"{prefix}.{unknown[0]} is not a structured output kind or option; the kinds are "
                             f"{', '.join(KINDS)}, the option disable_any_whitespace")
        kw = {k: v for k, v in body.items() if v is not None}
        for name in ("json", "structural_tag"):
            if isinstance(kw.get(name), (dict, bool)) and not (name == "structural_tag" and isinstance(kw[name], bool)):
                kw[name] = json.dumps(kw[name])
        if isinstance(kw.get("choice"), list):
            kw["choice"] = tuple(kw["choice"])
        out = cls(**kw)
        out.validate(prefix)
        return out


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
