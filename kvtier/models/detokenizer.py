"""Incremental detokenization: turn a growing list of token ids into text deltas."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.models.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"
# Prompt tokens decoded before the output, as in vLLM: the output's first token then decodes as
# it does inside the text (a SentencePiece decoder strips the leading space of a text's first
# token only). A longer context is taken when a shorter one starts inside a character.
_MIN_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24


class IncrementalDetokenizer:
    """Feed the ids of one output sequence step by step and get the new text each time.

    A character split across tokens (multi-byte UTF-8 under byte-level BPE) decodes to U+FFFD
    until its last byte arrives, so text ending in U+FFFD is held back. The deltas concatenate to
    `tokenizer.decode(context + all ids)` less the text of `context`, the last few prompt ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The prompt context, then the output ids.
        self.token_ids: list[int] = self._prompt_context(prompt_token_ids)
        self.text = ""
        # token_ids[prefix_offset:read_offset] were already emitted (or are the context); their
        # text is decoded again with the new ids so a token's text can depend on its left
        # neighbour.
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest prompt suffix of at least _MIN_CONTEXT_TOKENS ids (or the whole prompt)
        that decodes without U+FFFD; none when every candidate splits a character."""
        ids = list(prompt_token_ids)
        for size in range(min(_MIN_CONTEXT_TOKENS, len(ids)),
                          min(_MAX_CONTEXT_TOKENS, len(ids)) + 1):
            context = ids[len(ids) - size:]
            if _INCOMPLETE not in self._decode(context):
                return context
        return []

    def step(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text they completed ("" while a character is incomplete)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (U+FFFD for a broken tail)."""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
