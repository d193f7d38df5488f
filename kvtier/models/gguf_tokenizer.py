"""Rebuild a byte-level BPE `tokenizers` tokenizer from GGUF tokenizer metadata
(tokenizer.ggml.model == "gpt2": tokens, merges, token types, special ids, chat template)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvtier.models.errors import ModelLoadError
from kvtier.models.tokenizer import Tokenizer

# llama.cpp token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4
# The named special tokens besides bos and eos, as tokenizer_config.json names them, by the
# metadata key of their id ("seperator" is GGUF's spelling).
_OTHER_SPECIAL_IDS = {"unk_token": "tokenizer.ggml.unknown_token_id",
                      "pad_token": "tokenizer.ggml.padding_token_id",
                      "sep_token": "tokenizer.ggml.seperator_token_id",
                      "mask_token": "tokenizer.ggml.mask_token_id"}

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return build


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # Digits one by one, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# tokenizer.ggml.pre -> pre-tokenizer builder.
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2, "gpt2": _gpt2, "smollm": _smollm,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT), "qwen2": _split_then_bytes(_QWEN2_SPLIT),
}


def _tokens(fields: dict[str, Any], path: str) -> list[str]:
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(path, "tokenizer.ggml.model is set but tokenizer.ggml.tokens is "
                                   "missing or empty")
    return tokens


def _special_token(fields: dict[str, Any], key: str, tokens: list[str],
                   path: str) -> tuple[str | None, int | None]:
    """(token, id) of the special token metadata key `key` names; (None, None) if absent."""
    token_id = fields.get(key)
    if token_id is None:
        return None, None
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
        raise ModelLoadError(path, f"{key} {token_id!r} is out of range for the "
                                   f"{len(tokens)} tokens of tokenizer.ggml.tokens")
    return tokens[token_id], token_id


def _other_special_tokens(fields: dict[str, Any], tokens: list[str]) -> dict[str, str]:
    """unk_token, pad_token... for chat templates to print, as an HF directory's tokenizer
    gives them. An id outside the vocabulary is left out, as llama.cpp leaves it out: only a
    template that prints the token sees the difference, where a refusal would stop the load."""
    named = {}
    for name, key in _OTHER_SPECIAL_IDS.items():
        token_id = fields.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            named[name] = tokens[token_id]
    return named


def _backend(fields: dict[str, Any], tokens: list[str], path: str) -> BackendTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(path, f"tokenizer.ggml.pre {pre!r} is not supported; known: "
                                   f"{', '.join(sorted(PRE_TOKENIZERS))}")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=pre == "llama-bpe")
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(types) if kind == _USER_DEFINED])
    return backend


def tokenizer_from_gguf(fields: dict[str, Any], path: str,
                        extra_eos_token_ids: tuple[int, ...] = ()) -> Tokenizer | None:
    """The GGUF's tokenizer, or None if the file carries none."""
    kind = fields.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise ModelLoadError(path, f"tokenizer.ggml.model {kind!r} is not supported; kvtier "
                                   "reads byte-level BPE ('gpt2') tokenizers")
    tokens = _tokens(fields, path)
    backend = _backend(fields, tokens, path)
    bos, bos_id = _special_token(fields, "tokenizer.ggml.bos_token_id", tokens, path)
    eos, _ = _special_token(fields, "tokenizer.ggml.eos_token_id", tokens, path)
    if bos is not None and fields.get("tokenizer.ggml.add_bos_token", False):
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return Tokenizer(backend, bos_token=bos, eos_token=eos,
                     chat_template=fields.get("tokenizer.chat_template"),
                     extra_eos_token_ids=extra_eos_token_ids,
                     other_special_tokens=_other_special_tokens(fields, tokens))
