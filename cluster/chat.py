"""The `chat` input: its messages checked and rendered, with its tools (each edge checked those), by the model's chat
template into text the tokenizer encodes without adding special tokens (the template wrote them); a tool choice that
forces calls becomes the request's grammar."""

from __future__ import annotations

from dspark_serve.engine.structured_outputs import StructuredOutputsParams
from dspark_serve.models.chat_template import ChatTemplate, ChatTemplateError, render_chat

from . import tool_calls
from .gateway_request import Chat

ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")
AUTO_NEEDS_FLAG = ('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                   '--tool-call-parser hermes')


class ChatText(str):
    """A rendered conversation: a text prompt whose special tokens are already in it."""


def render(template: ChatTemplate | None, chat: Chat) -> ChatText:
    """Raises ValueError naming the field: no template, no messages, an unknown role, or a template that fails."""
    if template is None:
        raise ValueError("chat input needs a chat template: the target has none; start the server with "
                         "--chat-template FILE")
    if not chat.messages:
        raise ValueError("chat.messages is empty")
    messages = []
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise ValueError(f"chat.messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}")
        message = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = tool_calls.chat_messages_for_template(list(m.tool_calls))
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    tools = None if chat.tools is None else list(chat.tools)
    try:
        text = render_chat(template, messages, add_generation_prompt=chat.add_generation_prompt, tools=tools)
    except ChatTemplateError as e:  # the template's own words; where it was read from stays here
        raise ValueError(f"chat: the chat template failed: {e.__cause__ or e}") from None
    if not text:
        raise ValueError("chat: the chat template rendered an empty prompt")
    return ChatText(text)


def tool_choice_grammar(chat: Chat, auto_tool_choice: bool) -> StructuredOutputsParams | None:
    """The grammar a forced tool choice puts on the output ("required" or a named function), or None; ValueError
    naming the field for a bad choice, and for "auto" (the default with tools) on a server without
    --enable-auto-tool-choice."""
    choice = chat.tool_choice or ("auto" if chat.tools is not None else "none")
    if choice not in TOOL_CHOICES:
        raise ValueError(f"chat.tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {choice!r}")
    if chat.tools is None:
        if chat.tool_choice_function or choice == "required":
            raise ValueError("chat.tool_choice needs chat.tools_json: there are no tools to call")
        return None
    if choice == "auto" and not chat.tool_choice_function and not auto_tool_choice:
        raise ValueError(AUTO_NEEDS_FLAG)
    tag = tool_calls.choice_grammar(list(chat.tools), choice, chat.tool_choice_function, chat.parallel_tool_calls,
                                    "chat.tool_choice_function")
    return StructuredOutputsParams(structural_tag=tag) if tag is not None else None
