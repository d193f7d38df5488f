"""A SentencePiece-style tokenizer.json as Llama-2 and Mistral ship it (transformers' legacy
LlamaConverter layout): BPE over "▁"-marked words with byte fallback, and a decoder that strips
the text's leading space."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, normalizers

from ..tiny_models import VOCAB

SPECIALS = ["<unk>", "<s>", "</s>"]
# "é" is the two byte-fallback tokens <0xC3> <0xA9>; the rest are "▁w{id}" words.
PIECES = [*SPECIALS, "<0xC3>", "<0xA9>", "▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris",
          "."]
PIECES += [f"▁w{i}" for i in range(len(PIECES), VOCAB)]
ID = {piece: i for i, piece in enumerate(PIECES)}


def sentencepiece_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(vocab=dict(ID), merges=[], unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                 normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def save_sentencepiece_tokenizer(directory) -> Tokenizer:
    """Writes tokenizer.json and tokenizer_config.json (bos <s>, eos </s>) into `directory`."""
    tokenizer = sentencepiece_tokenizer()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    return tokenizer
