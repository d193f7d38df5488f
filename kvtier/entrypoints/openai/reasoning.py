"""Reasoning models' thinking apart from their answer (`--reasoning-parser`), as vLLM gives it:
the text between `<think>` and `</think>` is the message's `reasoning`, what follows is its
`content` (tool calls are looked for there).

deepseek_r1: the output is reasoning until `</think>`, whether or not it opened with
`<think>` (DeepSeek-R1's and QwQ's templates open it in the prompt). qwen3: reasoning only when
the output opens with `<think>` (Qwen3 writes it itself; with thinking off, all is content).
A structured output constraint holds the answer only: it starts after the `</think>` token
(`grammar_start`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.models.tokenizer import Tokenizer

START, END = "<think>", "</think>"


def split_reasoning(parser: str | None, text: str,
                    closed: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output; None for a part it does not have.
    `closed`: the prompt already ended the thinking (all of the output is content)."""
    if parser is None or closed:
        return None, text
    body = text.lstrip()
    if body.startswith(START):
        body = body[len(START):]
    elif parser == "qwen3":
        return None, text
    end = body.find(END)
    if end < 0:
        return body, None
    return body[:end], body[end + len(END):] or None


def _settled(parser: str | None, text: str, closed: bool) -> tuple[str, str]:
    """(reasoning, content) of an unfinished output, less what may still become a tag."""
    if parser is None or closed:
        return "", text
    body = text.lstrip()
    if START.startswith(body) and body != START:
        return "", ""  # perhaps "<think>" coming
    if body.startswith(START):
        body = body[len(START):]
    elif parser == "qwen3":
        return "", text
    end = body.find(END)
    if end >= 0:
        return body[:end], body[end + len(END):]
    for keep in range(min(len(END) - 1, len(body)), 0, -1):
        if END.startswith(body[-keep:]):
            return body[:-keep], ""
    return body, ""


class ReasoningStream:
    """A streamed answer's reasoning, per choice: what to send now, and the content so far."""

    def __init__(self, parser: str | None, closed: bool = False) -> None:
        self.parser = parser
        self.closed = closed  # the prompt ended the thinking: all is content
        self._sent: dict[int, int] = {}  # choice index -> characters of reasoning sent

    def step(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning to send now, the whole content so far) for a choice whose whole text so
        far is `text`."""
        if finished:
            reasoning, content = split_reasoning(self.parser, text, self.closed)
            reasoning, content = reasoning or "", content or ""
        else:
            reasoning, content = _settled(self.parser, text, self.closed)
        sent = self._sent.get(index, 0)
        self._sent[index] = max(sent, len(reasoning))
        return reasoning[sent:], content


def thinking_tokens(tokenizer: Tokenizer | None, parser: str) -> tuple[int, int]:
    """The ids of `<think>` and `</think>`; ValueError if the model has no such tokens."""
    ids = [None if tokenizer is None else tokenizer.backend.token_to_id(tag)
           for tag in (START, END)]
    if None in ids:
        raise ValueError(f"--reasoning-parser {parser}: this model's tokenizer has no {START} "
                         f"and {END} tokens; it is not a reasoning model this parser reads")
    return ids[0], ids[1]


def thinking_closed(prompt_token_ids: Sequence[int], start_id: int, end_id: int) -> bool:
    """Whether the prompt already ended the thinking (a template that turns thinking off
    writes an empty `<think></think>`): the output is then all answer, and a structured output
    constraint holds from its first token instead of after `</think>`."""
    last_start = last_end = -1
    for position, token in enumerate(prompt_token_ids):
        if token == start_id:
            last_start = position
        elif token == end_id:
            last_end = position
    return last_end > last_start
