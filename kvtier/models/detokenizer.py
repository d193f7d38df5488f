"""Incremental detokenization: turn a growing list of token ids into text deltas."""

from __future__ import annotations

from kvtier.models.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Feed the ids of one output sequence step by step and get the new text each time.

    A character split across tokens (multi-byte UTF-8 under byte-level BPE) decodes to U+FFFD
    until its last byte arrives, so text ending in U+FFFD is held back. The deltas concatenate to
    `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        # token_ids[prefix_offset:read_offset] were already emitted; their text is decoded again
        # with the new ids so a token's text can depend on its left neighbour.
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

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
