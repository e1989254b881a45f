"""The `chat` input: messages checked and rendered with the model's chat template, into text the tokenizer encodes
without adding special tokens (the template wrote them)."""

from __future__ import annotations

from dspark_serve.models.chat_template import ChatTemplate, ChatTemplateError, render_chat
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

ROLES = ("system", "user", "assistant", "tool")


class ChatText(str):
    """A rendered conversation: a text prompt whose special tokens are already in it."""


def render(template: ChatTemplate | None, chat: pb.Chat) -> ChatText:
    """Raises ValueError naming the field: no template, no messages, an unknown role, or a template that fails."""
    if template is None:
        raise ValueError("chat input needs a chat template: the target has none; start the server with "
                         "--chat-template FILE")
    if not chat.messages:
        raise ValueError("chat.messages is empty")
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise ValueError(f"chat.messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        text = render_chat(template, messages, add_generation_prompt=add)
    except ChatTemplateError as e:  # the template's own words; where it was read from stays here
        raise ValueError(f"chat: the chat template failed: {e.__cause__ or e}") from None
    if not text:
        raise ValueError("chat: the chat template rendered an empty prompt")
    return ChatText(text)
