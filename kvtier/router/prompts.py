"""A request body -> its prompt's block hashes, computed exactly as the engines compute them.

The prompt goes through the OpenAI server's own rendering and tokenization code (chat template
included) with the instances' tokenizer, and the block hashes through the engine's own
`Request` and block hasher; only the tokenizer is loaded, never the weights (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvtier.entrypoints.anthropic.convert import chat_request as messages_chat_request
from kvtier.entrypoints.anthropic.protocol import MessagesRequest
from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.prompts import chat_prompt, completion_prompts
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest
from kvtier.entrypoints.openai.responses.convert import (
    chat_request,
    input_messages,
    with_instructions,
)
from kvtier.entrypoints.openai.responses.protocol import ResponsesRequest
from kvtier.events import external_block_hash
from kvtier.kv.hashing import make_block_hasher
from kvtier.kv.request import Request
from kvtier.models.errors import ChatTemplateError, ModelLoadError
from kvtier.models.tokenizer import Tokenizer

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
# The paths that generate: routed by their prompt, and prefilled elsewhere in P/D mode.
GENERATION_PATHS = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, MESSAGES_PATH)
# Token ids are checked by the instance, which knows its vocabulary; the router takes any.
_ANY_VOCAB = 1 << 62


@dataclass(frozen=True)
class _TokenizeContext:
    """The two things the server's prompt code reads from its context."""

    tokenizer: Tokenizer | None
    vocab_size: int = _ANY_VOCAB


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of an HF directory or a .gguf file (its metadata only)."""
    if model.endswith(".gguf"):
        import gguf

        from kvtier.models.gguf_tokenizer import tokenizer_from_gguf

        try:
            reader = gguf.GGUFReader(model)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(model, f"cannot read the GGUF file ({exc})") from exc
        fields = {key: field.contents() for key, field in reader.fields.items()}
        return tokenizer_from_gguf(fields, model, ())
    return Tokenizer.from_hf_dir(model)


@dataclass(frozen=True)
class AdapterKey:
    """A LoRA adapter as an instance's kv_events_info names it (kvtier.kv.request.LoRAIdentity)."""

    name: str
    cache_key: str


class PromptHasher:
    def __init__(self, tokenizer: Tokenizer | None, block_size: int, hash_algo: str) -> None:
        self.block_size = block_size
        self._context = _TokenizeContext(tokenizer)
        self._hasher = make_block_hasher(block_size, hash_algo)
        # The instances' LoRA adapters by name: a request whose `model` names one hashes its
        # blocks with the adapter's key, as the engine does.
        self._adapters: dict[str, AdapterKey] = {}

    def add_adapters(self, adapters: dict[str, str]) -> None:
        """name -> cache_key, from an instance's kv_events_info."""
        self._adapters.update((name, AdapterKey(name, key)) for name, key in adapters.items())

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the instance will see them; None when the body is not a
        request the router can read (the instance answers it with the error)."""
        try:
            if path == CHAT_PATH:
                return chat_prompt(self._context,
                                   ChatCompletionRequest.model_validate(body)).token_ids
            if path == RESPONSES_PATH:
                return self._response_token_ids(body)
            if path == MESSAGES_PATH:
                request = messages_chat_request(MessagesRequest.model_validate(body))
                return chat_prompt(self._context, request).token_ids
            # Several prompts are served together by one instance: the first one decides.
            return completion_prompts(self._context, body.get("prompt"))[0].token_ids
        except (BadRequestError, ValidationError, ChatTemplateError, TypeError):
            return None

    def _response_token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """A Responses request's prompt; None when it goes on from a stored response (its
        earlier turns are on the instance that stores it, where the request goes)."""
        request = ResponsesRequest.model_validate(body)
        if request.previous_response_id is not None or request.input is None:
            return None
        messages = with_instructions(request.instructions, input_messages(request.input))
        return chat_prompt(self._context, chat_request(request, messages)).token_ids

    def block_hashes_of(self, token_ids: list[int], cache_salt: Any = None,
                        model: Any = None) -> list[int]:
        """The 64-bit hashes of the full blocks of a prompt with these token ids, for the
        request's `model` (a LoRA adapter's name, or the base model's)."""
        request = Request("router", token_ids,
                          cache_salt=cache_salt if isinstance(cache_salt, str) else None,
                          lora=self._adapters.get(model) if isinstance(model, str) else None,
                          block_hasher=self._hasher)
        return [external_block_hash(h) for h in request.block_hashes]
