"""Tokenizer: a `tokenizers` backend plus the facts the engine needs (special ids, chat template).

Built from an HF directory (tokenizer.json, tokenizer_config.json, chat_template.jinja) or from a
GGUF file's metadata (`gguf_tokenizer.py`).
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from kvtier.models.chat_template import compile_chat_template
from kvtier.models.errors import ChatTemplateError, ModelLoadError
from kvtier.models.hf_config import read_json


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None,
                 eos_token: str | None, chat_template: str | None,
                 extra_eos_token_ids: tuple[int, ...] = (),
                 other_special_tokens: dict[str, str] | None = None) -> None:
        """`other_special_tokens`: the named special tokens besides bos and eos (unk_token,
        pad_token, a model's image_token...), which chat templates may print."""
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        eos = [] if eos_token is None else [backend.token_to_id(eos_token)]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in [*eos, *extra_eos_token_ids] if i is not None))
        self.other_special_tokens = dict(other_special_tokens or {})

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Safe to call from several threads at once. `encode_batch` lets go of the GIL while
        it works (`encode` holds it throughout): a long prompt tokenized on a server thread
        then leaves the event loop running."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def set_chat_template(self, template: str) -> None:
        """Use `template` instead of the model's (compiled now: a syntax error is raised here,
        as ChatTemplateError)."""
        self.chat_template = template
        self.__dict__.pop("_compiled_template", None)
        self._compiled_template  # noqa: B018 (compiles it)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template; pass a plain "
                                    "prompt instead of chat messages")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat rendered as one prompt string. It usually carries its own special tokens:
        encode it with add_special_tokens=False. The template sees what transformers'
        apply_chat_template shows it: the special tokens the tokenizer has (one it lacks is
        undefined), `tools` and `documents` as None unless `kwargs` set them, then `kwargs`."""
        template = self._compiled_template
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs,
                     "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return template.render(variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens this tokenizer has, by name (bos_token, unk_token...)."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return {**{k: v for k, v in named.items() if v is not None}, **self.other_special_tokens}

    @classmethod
    def from_hf_dir(cls, model_dir: str,
                    extra_eos_token_ids: tuple[int, ...] = ()) -> Tokenizer | None:
        """The directory's tokenizer, or None if it has no tokenizer.json."""
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        try:
            backend = BackendTokenizer.from_file(path)
        except Exception as exc:  # the Rust parser raises a bare Exception
            raise ModelLoadError(path, f"not a valid tokenizer.json ({exc})") from exc
        config = _with_special_tokens_map(model_dir, _read_optional(model_dir,
                                                                    "tokenizer_config.json"))
        return cls(backend, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")),
                   chat_template=_chat_template(model_dir, config),
                   extra_eos_token_ids=extra_eos_token_ids,
                   other_special_tokens=_other_special_tokens(config))


def _read_optional(model_dir: str, name: str) -> dict[str, Any]:
    path = os.path.join(model_dir, name)
    return read_json(path) if os.path.isfile(path) else {}


def _with_special_tokens_map(model_dir: str, config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the named special tokens it lacks taken from special_tokens_map.json,
    where older checkpoints name them (bos and eos too) and transformers reads them."""
    named = _read_optional(model_dir, "special_tokens_map.json")
    missing = {key: value for key, value in named.items()
               if key.endswith("_token") and _is_token(value) and config.get(key) is None}
    return {**config, **missing}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


def _other_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The config's named special tokens but bos and eos, read as transformers reads them: each
    `*_token` key holding a token (unk_token, pad_token, image_token...), and those of the
    `extra_special_tokens` table when it is one (a list there names no token)."""
    extra = config.get("extra_special_tokens")
    named = {**config, **(extra if isinstance(extra, dict) else {})}
    return {key: _token_text(value) for key, value in named.items()
            if key.endswith("_token") and _is_token(value)
            and key not in ("bos_token", "eos_token")}


def _is_token(value: Any) -> bool:
    # Flags such as add_bos_token also end in "_token".
    return isinstance(value, str) or (isinstance(value, dict) and "content" in value)


def _chat_template(model_dir: str, config: dict[str, Any]) -> str | None:
    # transformers 5 writes the template to its own file; older versions put it in the config,
    # possibly as a list of named templates.
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template
