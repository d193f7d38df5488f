"""A chat as one prompt string: the options OpenAI's and vLLM's chat requests take, shared by
the server and `LLM.chat` so that both render a conversation alike."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.models.errors import ChatTemplateError, UnsupportedContentError
from kvtier.models.tokenizer import Tokenizer

# Template variables chat_template_kwargs may not replace: the request's own fields and the
# template's helpers. Other special tokens, `tools` and `documents` they may, as in transformers.
_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                             "raise_exception", "strftime_now"})


def read_chat_template(value: str) -> str:
    """A chat template given as a file's path or as the template itself (`--chat-template`)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r}: no such file; give the path of a file "
                         "holding a Jinja chat template, or the template itself")
    return value


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Mapping[str, Any] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The messages through the chat template. A message's content may be a string or
    OpenAI's list of text parts (joined by newlines). `continue_final_message` leaves the
    last message open for the model to go on with; `chat_template_kwargs` are extra template
    variables (e.g. enable_thinking); `tools` (OpenAI's function tools) is the template's
    `tools`. ChatTemplateError names the field at fault."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message needs add_generation_prompt set to false "
                                "(the last message is continued, not answered)",
                                param="continue_final_message")
    variables = dict(chat_template_kwargs or {})
    taken = sorted(_TEMPLATE_NAMES.intersection(variables))
    if taken:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)}: the "
                                "request's own fields do", param="chat_template_kwargs")
    if tools is not None:
        variables["tools"] = list(tools)
    plain = [{**message, "content": text_of(message.get("content"), f"messages[{i}].content")}
             for i, message in enumerate(messages)]
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                         **variables)
    if continue_final_message and plain:
        text = _open_final_message(text, plain[-1]["content"])
    return text


def text_of(content: Any, param: str) -> str:
    """A message's content as text: a string, None (""), or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ChatTemplateError(f"{param} must be a string or a list of text parts",
                                param=param)
    texts = []
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(part, Mapping) or part.get("type") != "text" or \
                not isinstance(text, str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise UnsupportedContentError(f"content part type '{kind}' is not supported; only "
                                          f"text", param=f"{param}[{j}].type")
        texts.append(text)
    return "\n".join(texts)


def _open_final_message(text: str, content: str) -> str:
    """The rendered chat cut just after the last message's text, so that the model goes on
    with it (what the template writes to close the message is dropped). Templates often strip
    a message's text: it is looked for stripped."""
    content = content.strip()
    end = text.rfind(content) if content else -1
    if end < 0:
        raise ChatTemplateError("continue_final_message needs the last message's text in the "
                                "rendered chat, and this chat template leaves it out or "
                                "changes it", param="continue_final_message")
    return text[:end + len(content)]
