"""The multi-turn workload: deterministic conversation scripts built from the fixed word list."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NewType

from kvtier.entrypoints.bench.config import MultiTurnConfig
from kvtier.entrypoints.bench.words import WORDS

ConversationId = NewType("ConversationId", int)


@dataclass(frozen=True)
class ConversationScript:
    """What the client says in one conversation; the server's replies are added at run time."""

    conversation_id: ConversationId
    system_prompt: str  # the shared prefix, then this conversation's own context
    user_messages: tuple[str, ...]  # one per turn


def make_text(rng: random.Random, num_tokens: int) -> str:
    """`num_tokens` words of the fixed list, space separated: `num_tokens` tokens (see words.py)."""
    return " ".join(rng.choice(WORDS) for _ in range(num_tokens))


def _rng(seed: int, part: str) -> random.Random:
    # A string seed is hashed with SHA-512 by `random`, so every part of the workload gets its own
    # stream that is identical in every process, whatever PYTHONHASHSEED is.
    return random.Random(f"kvtier-multi-turn:{seed}:{part}")


def build_conversations(config: MultiTurnConfig) -> list[ConversationScript]:
    """The scripts of all conversations; the same config always gives the same text."""
    shared_prefix = make_text(_rng(config.seed, "system"), config.system_prompt_tokens)
    return [_build_one(config, shared_prefix, ConversationId(i))
            for i in range(config.num_conversations)]


def _build_one(config: MultiTurnConfig, shared_prefix: str,
               conversation_id: ConversationId) -> ConversationScript:
    context = make_text(_rng(config.seed, f"context:{conversation_id}"), config.context_tokens)
    turns_rng = _rng(config.seed, f"turns:{conversation_id}")
    user_messages = tuple(make_text(turns_rng, config.user_tokens)
                          for _ in range(config.num_turns))
    # The conversation number leads the context so that two conversations diverge right after
    # the shared prefix even when context_tokens is 0.
    system_prompt = f"{shared_prefix}\nConversation {conversation_id}: {context}".strip()
    return ConversationScript(conversation_id, system_prompt, user_messages)


def render_completion_prompt(messages: list[dict[str, str]]) -> str:
    """A chat history as one plain-text prompt, for servers driven through /v1/completions.

    A reply is pasted verbatim after "Assistant:", where the model wrote it, so each turn's prompt
    extends the previous prompt plus its reply and the server's prefix cache can hit all of it.
    """
    lines = [f"Assistant:{m['content']}" if m["role"] == "assistant"
             else f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"
