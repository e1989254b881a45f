"""Chat templates rendered as transformers renders them: the model's Jinja template (chat_template.jinja, else
tokenizer_config.json's "chat_template"; a file given by path overrides both) run in Jinja's immutable sandbox."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
LEGACY_TOKENS_FILE = "special_tokens_map.json"
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class ChatTemplateError(ValueError):
    """No template, a template that does not compile or raises, or messages it cannot take; one line for the user."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, where it was read from, and the named special tokens the template sees."""

    source: str
    template: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"eos_token": "<|im_end|>"}


def load_chat_template(model_dir: str | Path, template_file: str | Path | None = None) -> ChatTemplate:
    """`template_file` if given, else `model_dir`'s chat_template.jinja, else its tokenizer_config.json entry
    (a string, or a list of {name, template} whose "default" is used)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / CONFIG_FILE)
    tokens = _special_tokens(config, _read_json(model_dir / LEGACY_TOKENS_FILE))
    if template_file is not None:
        path = Path(template_file)
        try:
            return ChatTemplate(str(path), path.read_text(encoding="utf-8"), tokens)
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"chat template file {path}: cannot read it ({e})") from e
    if (model_dir / TEMPLATE_FILE).is_file():
        return ChatTemplate(str(model_dir / TEMPLATE_FILE), (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8"),
                            tokens)
    if config.get("chat_template") is not None:
        where = str(model_dir / CONFIG_FILE)
        return ChatTemplate(where, _default_template(config["chat_template"], where), tokens)
    config_state = "has no \"chat_template\"" if (model_dir / CONFIG_FILE).is_file() else "does not exist"
    raise ChatTemplateError(f"{model_dir}: no chat template: {TEMPLATE_FILE} does not exist and {CONFIG_FILE} "
                            f"{config_state}; give one with --chat-template FILE")


def render_chat(template: ChatTemplate, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                **kwargs: Any) -> str:
    """The conversation as text. `kwargs` reach the template as variables (e.g. enable_thinking=False) and
    override the special tokens of the same name."""
    chat = _checked_messages(messages)
    compiled = _compile(template.template, template.source)
    variables = {**template.special_tokens, **kwargs}
    try:
        return compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template {template.source} raised: {e}") from e
    except Exception as e:  # the template is foreign code: any failure in it is reported as the template's
        raise ChatTemplateError(f"chat template {template.source} failed: {type(e).__name__}: {e}") from e


def encode_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict[str, Any]],
                add_generation_prompt: bool = False, **kwargs: Any) -> list[int]:
    """Token ids of `render_chat`'s text; the template writes its own special tokens, so none are added."""
    text = render_chat(template, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False).ids


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise ChatTemplateError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _default_template(entry: Any, where: str) -> str:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in entry):
        named = {t["name"]: t["template"] for t in entry}
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(f"{where}: chat_template has no \"default\" among {sorted(named)}; "
                                "give one with --chat-template FILE")
    raise ChatTemplateError(f"{where}: chat_template must be a string or a list of {{name, template}}, "
                            f"got {type(entry).__name__}")


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialized AddedToken
        return value["content"]
    return None


def _special_tokens(config: dict[str, Any], legacy: dict[str, Any]) -> dict[str, str]:
    """Every `*_token` string of the config and its named extra tokens; special_tokens_map.json counts, and wins,
    only in configs without "added_tokens_decoder", as transformers reads them."""
    found = {k: v for k, v in config.items() if k.endswith("_token")}
    if "added_tokens_decoder" not in config:
        found.update((k, v) for k, v in legacy.items() if k.endswith("_token"))
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(config.get(key), dict):
            found.update(config[key])
    return {k: text for k, v in found.items() if (text := _token_text(v)) is not None}


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """Fresh copies without None values (templates test for a missing key, not for None); reasoning under any of
    its names also appears as reasoning_content and thinking."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"messages: expected a non-empty list of {{role, content}} dicts, "
                                f"got {_short(messages)}")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}]: expected a dict with string 'role' and 'content', "
                                    f"got {_short(message)}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "nothing" if message.get(key) is None else _short(message[key])
                raise ChatTemplateError(f"messages[{i}]: {key!r} must be a string, got {got}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


class _Generation(Extension):
    """`{% generation %}` marks assistant text for training masks; rendering keeps the text as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which would reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: namespace(self=...) stays a plain name
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` without the type itself, whose attributes lead out of the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Plain json.dumps: Jinja's own filter escapes <, >, & and ' for HTML, which chat prompts must not get."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=_Namespace, dict=_Dict())
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template {source}: line {e.lineno}: {e.message}") from e
