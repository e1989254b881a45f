"""Chat templates against transformers' apply_chat_template: the demo target's (written by the GGUF converter),
Qwen3's, the tiny GGUF's and one written here; where templates are found, and the errors."""

import json
import os
from datetime import datetime
from pathlib import Path

import pytest
import torch
from gguf_tiny import CHAT_TEMPLATE, write_tiny_gguf

from dspark_serve.models.chat_template import (ChatTemplate, ChatTemplateError, encode_chat, load_chat_template,
                                               render_chat)
from dspark_serve.models.demo import demo_target_dir
from dspark_serve.models.fetch import default_cache_dir
from dspark_serve.models.gguf_convert import convert_gguf
from dspark_serve.models.tokenizer import load_tokenizer

DEMO = demo_target_dir()
QWEN3 = Path(os.environ.get("DSPARK_QWEN_TOKENIZER", default_cache_dir() / "qwen3-tokenizer"))
SYSTEM = {"role": "system", "content": "You are a terse coding assistant."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


DEMO_CHATS = {
    "system+user": [SYSTEM, user("Write a Python function that reverses a string.")],
    "user only": [user("What is 2 + 2?")],
    "multi-turn": [user("Hi"), assistant("Hello! How can I help?"), user("Sort [3, 1, 2] in Python.")],
    "system+multi-turn": [SYSTEM, user("def f(x): return x"), assistant("```python\ndef f(x):\n    return x\n```"),
                          user("Add a docstring."), assistant("Done."), user("Thanks")],
    "unicode": [user("Traduis « héllo wörld » — 你好，世界！🙂🚀 naïve café ☕ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢")],
    "cjk system": [{"role": "system", "content": "你是一个乐于助人的助手。"}, user("用 Python 写快速排序。")],
    "empty user": [user("")],
    "whitespace": [SYSTEM, user(" \n\t "), assistant(""), user("\n")],
    "control tokens in text": [user("print('<|im_end|>') then <|im_start|>user<|endoftext|>")],
    "code": [user("def fib(n):\n\tif n < 2:\n\t\treturn n\n\treturn fib(n-1) + fib(n-2)\n\n\n# why slow?   ")],
    "ends with assistant": [SYSTEM, user("Name a color."), assistant("Blue")],
    "tool results": [user("Weather in Paris?"), assistant("Checking."), {"role": "tool", "content": '{"temp": 21}'},
                     {"role": "tool", "content": "sunny"}],
    "system only": [SYSTEM],
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & 'later' in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _reference(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path)


def _assert_same(ref, template: ChatTemplate, tokenizer, messages: list, **kwargs) -> str:
    """Text first (a mismatch shows where), then ids; returns the text."""
    text = render_chat(template, messages, **kwargs)
    assert text == ref.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert encode_chat(template, tokenizer, messages, **kwargs) == ids
    return text


# The demo target, as `dspark-serve fetch` converts it.

@pytest.fixture(scope="module")
def demo():
    if not (DEMO / ".dspark-converted").is_file():
        pytest.skip(f"demo target not cached at {DEMO} (dspark-serve fetch)")
    config = DEMO / "tokenizer_config.json"
    if not config.is_file() or "chat_template" not in json.loads(config.read_text()):
        pytest.skip(f"{DEMO} has no chat template in tokenizer_config.json "
                    "(convert it again: dspark-serve fetch --force)")
    return _reference(DEMO), load_chat_template(DEMO), load_tokenizer(DEMO)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(DEMO_CHATS))
def test_demo_target_matches_transformers(demo, name, add_generation_prompt):
    ref, template, tokenizer = demo
    text = _assert_same(ref, template, tokenizer, DEMO_CHATS[name], add_generation_prompt=add_generation_prompt)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    if name == "user only":
        assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_demo_target_tools_and_tool_calls(demo):
    ref, template, tokenizer = demo
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich <3>"}}}]}
    messages = [SYSTEM, user("Weather?"), call, {"role": "tool", "content": "21 °C"}]
    text = _assert_same(ref, template, tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert '"description": "Weather <now> & \'later\' in a city"' in text and '{"city": "Zürich <3>"}' in text


def test_demo_target_special_tokens_are_transformers(demo):
    ref, template, _ = demo
    assert template.special_tokens == ref.special_tokens_map == {
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


# Qwen3's official tokenizer files.

@pytest.fixture(scope="module")
def qwen3():
    if not (QWEN3 / "tokenizer_config.json").is_file():
        pytest.skip(f"Qwen3 tokenizer files not at {QWEN3} (set DSPARK_QWEN_TOKENIZER)")
    return _reference(QWEN3), load_chat_template(QWEN3), load_tokenizer(QWEN3)


QWEN3_CHATS = {
    "system+user": ([SYSTEM, user("Explain list comprehensions. 🐍")], {}),
    "no thinking": ([user("hi"), assistant("hello"), user("again")], {"enable_thinking": False}),
    "reasoning": ([user("2+2?"), {"role": "assistant", "content": "4", "reasoning_content": "2 plus 2"},
                   user("and 3+3?")], {}),
    "thinking alias": ([user("2+2?"), {"role": "assistant", "content": "4", "thinking": "add them"},
                        user("3+3?")], {"enable_thinking": True}),
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(QWEN3_CHATS))
def test_qwen3_matches_transformers(qwen3, name, add_generation_prompt):
    ref, template, tokenizer = qwen3
    messages, kwargs = QWEN3_CHATS[name]
    text = _assert_same(ref, template, tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    if name == "no thinking" and add_generation_prompt:
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.special_tokens == ref.special_tokens_map


# The tiny GGUF: the converter writes its template and special tokens; transformers reads the folder the same way.

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    gguf = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return convert_gguf(gguf, tmp_path_factory.mktemp("hf"), dtype=torch.float32, progress=False)


def test_converter_writes_chat_template_and_special_tokens(tiny_folder):
    config = json.loads((tiny_folder / "tokenizer_config.json").read_text())
    assert config == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "unk_token": None, "pad_token": None,
                      "chat_template": CHAT_TEMPLATE}
    assert {p.name for p in tiny_folder.iterdir()} == {"model.safetensors", "config.json", "generation_config.json",
                                                        "tokenizer.json", "tokenizer_config.json"}
    template = load_chat_template(tiny_folder)
    assert template.source == str(tiny_folder / "tokenizer_config.json")
    assert template.special_tokens == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


def test_tiny_template_renders_and_matches_transformers(tiny_folder):
    template, tokenizer = load_chat_template(tiny_folder), load_tokenizer(tiny_folder)
    messages = [SYSTEM, user("Hello, world!"), assistant("def fibonacci(n):"), user("héllo")]
    assert render_chat(template, messages[1:2], add_generation_prompt=True) == (
        "<|endoftext|><|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n")
    ids = encode_chat(template, tokenizer, messages[1:2])
    assert ids[:2] == [tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_start|>")]
    assert ids[-2:] == [tokenizer.token_to_id("<|im_end|>"), tokenizer.encode("\n").ids[0]]
    ref = _reference(tiny_folder)
    assert ref.special_tokens_map == template.special_tokens
    for add_generation_prompt in (True, False):
        _assert_same(ref, template, tokenizer, messages, add_generation_prompt=add_generation_prompt)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json raised: roles are system, user and "
                                                r"assistant, got tool$"):
        render_chat(template, [user("x"), {"role": "tool", "content": "y"}])


# A template written here: the helpers transformers gives templates, and where templates are found.

FEATURES = """{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message.role == "stop" %}
        {% break %}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    {% generation %}{{ message.role }}: {{ message.content | tojson }}{% endgeneration %}

{% endfor %}
{{ ns.count }} {{ dict(a=[1, "é<&>"]) | tojson }} {{ strftime_now("%Y") }} {{ flavour }} {{ eos_token }}
{%- if tools is none and documents is none %} no-tools{% endif %}
"""


def _write(folder: Path, config: dict | None = None, jinja: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_template_helpers_render_like_transformers(tmp_path):
    template = load_chat_template(_write(tmp_path, {"chat_template": FEATURES, "eos_token": "</s>"}))
    messages = [user('say "<b>" & \'é\''), assistant("ok"), {"role": "stop", "content": ""}, user("never")]
    text = render_chat(template, messages, flavour="mint")
    expected = 'user: "say \\"<b>\\" & \'é\'"\nassistant: "ok"\n2 {"a": [1, "é<&>"]} %d mint </s> no-tools'
    assert text in {expected % (datetime.now().year - k) for k in (0, 1)}
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    (ref,), _ = render_jinja_template([messages], chat_template=FEATURES, eos_token="</s>", flavour="mint")
    assert text == ref
    assert render_chat(template, messages[:1], eos_token="<|eot|>").split()[-2] == "<|eot|>"  # kwargs win


def test_where_the_template_comes_from(tmp_path):
    chatml = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    folder = _write(tmp_path / "a", {"chat_template": listed, "bos_token": {"content": "<s>", "lstrip": False},
                                     "image_token": "<img>", "unk_token": None, "add_bos_token": True})
    template = load_chat_template(folder)
    assert (template.template, template.source) == ("DEFAULT", str(folder / "tokenizer_config.json"))
    assert template.special_tokens == {"bos_token": "<s>", "image_token": "<img>"}
    _write(folder, jinja=chatml)  # chat_template.jinja wins over the config's entry, as in transformers 5
    assert load_chat_template(folder).source == str(folder / "chat_template.jinja")
    assert render_chat(load_chat_template(folder), [user("hi")]) == "<user>hi"
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }}{{ messages | length }}")
    assert render_chat(load_chat_template(folder, override), [user("a"), user("b")]) == "<s>2"
    assert render_chat(load_chat_template(tmp_path / "empty", override), [user("a")]) == "1"
    legacy = _write(tmp_path / "b", {"chat_template": "{{ eos_token }}", "eos_token": "</s>"})
    (legacy / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    assert render_chat(load_chat_template(legacy), [user("a")]) == "<|end|>"


def test_no_template_says_where_it_looked(tmp_path):
    with pytest.raises(ChatTemplateError, match=r"no chat template: chat_template.jinja does not exist and "
                                                r"tokenizer_config.json does not exist; "
                                                r"give one with --chat-template FILE"):
        load_chat_template(tmp_path)
    _write(tmp_path, {"eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json has no \"chat_template\"; "
                                                r".*--chat-template FILE"):
        load_chat_template(tmp_path)
    _write(tmp_path, {"chat_template": [{"name": "tool_use", "template": "x"}]})
    with pytest.raises(ChatTemplateError, match=r"no \"default\" among \['tool_use'\]"):
        load_chat_template(tmp_path)
    _write(tmp_path, {"chat_template": 7})
    with pytest.raises(ChatTemplateError, match="must be a string or a list of {name, template}, got int"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json: not readable JSON"):
        load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateError, match=r"chat template file .*missing.jinja: cannot read it"):
        load_chat_template(tmp_path / "x", tmp_path / "missing.jinja")


def test_template_errors(tmp_path):
    def template(text: str) -> ChatTemplate:
        return ChatTemplate("t.jinja", text)

    with pytest.raises(ChatTemplateError, match=r"t.jinja raised: only user turns$"):
        render_chat(template("{{ raise_exception('only user turns') }}"), [user("a")])
    with pytest.raises(ChatTemplateError, match=r"t.jinja: line 2: .*'endfor'"):
        render_chat(template("{% for m in messages %}\n{{ m }}"), [user("a")])
    with pytest.raises(ChatTemplateError, match=r"t.jinja failed: TypeError"):
        render_chat(template("{{ messages[0].content + 1 }}"), [user("a")])
    with pytest.raises(ChatTemplateError, match=r"t.jinja raised: .*unsafe"):  # the sandbox holds
        render_chat(template("{{ messages.__class__.__mro__ }}{{ messages.append(1) }}"), [user("a")])
    with pytest.raises(ChatTemplateError, match=r"t.jinja raised: .*'_x' on a namespace"):
        render_chat(template("{% set ns = namespace() %}{% set ns._x = 1 %}"), [user("a")])


@pytest.mark.parametrize("messages, error", [
    ("hello", r"messages: expected a non-empty list of {role, content} dicts, got str 'hello'"),
    ([], r"messages: expected a non-empty list .* got list \[\]"),
    ([user("a"), "b"], r"messages\[1\]: expected a dict with string 'role' and 'content', got str 'b'"),
    ([{"content": "a"}], r"messages\[0\]: 'role' must be a string, got nothing"),
    ([{"role": "user", "content": 3}], r"messages\[0\]: 'content' must be a string, got int 3"),
    ([{"role": "user", "content": None}], r"messages\[0\]: 'content' must be a string, got nothing"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], r"'content' must be a string, got list"),
])
def test_bad_messages(messages, error):
    with pytest.raises(ChatTemplateError, match=error):
        render_chat(ChatTemplate("t", "{{ messages }}"), messages)


def test_messages_are_copied_without_none_values():
    messages = [{"role": "assistant", "content": "a", "tool_calls": None, "reasoning": "r"}]
    text = render_chat(ChatTemplate("t", "{{ messages[0] | tojson(sort_keys=True) }}"), messages)
    assert json.loads(text) == {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r",
                                "thinking": "r"}
    assert messages == [{"role": "assistant", "content": "a", "tool_calls": None, "reasoning": "r"}]
