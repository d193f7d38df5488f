"""POST /tokenize and /detokenize, as vLLM has them: a prompt or a chat as the token ids the
generation endpoints would give the engine, and token ids back as text. No engine request is
made; the tokenizer runs here, off the event loop for long inputs as every endpoint does."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, StrictInt

from kvtier.entrypoints.openai.context import ServerContext
from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.prompts import (
    chat_prompt,
    check_in_vocabulary,
    check_text,
    message_chars,
)
from kvtier.entrypoints.openai.protocol import APIRequest, ChatCompletionRequest, ChatMessage
from kvtier.entrypoints.openai.sampling import refuse_unsupported
from kvtier.entrypoints.openai.tools import check_tools

# Fields of vLLM's chat form that the chat endpoint refuses too: ignoring one would answer
# tokens other than what vLLM computes.
_UNSUPPORTED_CHAT_FIELDS = {"chat_template": ()}


class TokenizeRequest(APIRequest):
    """vLLM's two forms in one body: `prompt` (completion form) or `messages` (chat form; the
    chat fields apply to it only). One model rather than a union, so that a refusal names the
    request's own field (`messages[0].role`), not a union branch."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Unset: vLLM's default for the form, true for a prompt and false for a chat (the template
    # writes the special tokens itself).
    add_special_tokens: StrictBool | None = None
    return_token_strs: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # The chat's function tools, as the chat endpoint hands them to the template.
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    # Only when asked for (return_token_strs).
    token_strs: list[str] | None = Field(default=None, exclude_if=lambda value: value is None)


class DetokenizeRequest(APIRequest):
    model: str | None = None
    # Strict: "5" or true is a client's mistake, not an id.
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def _ctx(raw: Request) -> ServerContext:
    return raw.app.state.ctx


# The server's API key guards these too (app.py).
router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> JSONResponse:
    ctx = _ctx(raw)
    check_text(body)  # first: an error message quoting a bad string could not be sent
    ctx.check_model(body.model)
    _check_form(body)
    num_chars = len(body.prompt) if body.prompt is not None \
        else message_chars(body.messages, body.tools)
    token_ids = await ctx.prepare(num_chars, _token_ids, ctx, body)
    token_strs = None
    if body.return_token_strs:
        token_strs = [ctx.tokenizer.backend.id_to_token(i) for i in token_ids]
    response = TokenizeResponse(count=len(token_ids), max_model_len=ctx.max_model_len,
                                tokens=token_ids, token_strs=token_strs)
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> JSONResponse:
    ctx = _ctx(raw)
    ctx.check_model(body.model)
    if ctx.tokenizer is None:
        raise BadRequestError("this model has no tokenizer, so it cannot detokenize",
                              param="tokens", code="invalid_value")
    check_in_vocabulary(ctx, body.tokens, "tokens")
    # A token stands for at least one character: long id lists go to a tokenizer thread too.
    # Special tokens stay in the text, as vLLM's detokenize keeps them.
    text = await ctx.prepare(len(body.tokens), ctx.tokenizer.decode, body.tokens, False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


def _check_form(body: TokenizeRequest) -> None:
    if body.prompt is None and body.messages is None:
        raise BadRequestError("send 'prompt' (text) or 'messages' (a chat) to tokenize",
                              param="prompt", code="missing_required_parameter")
    if body.prompt is not None and body.messages is not None:
        raise BadRequestError("send 'prompt' or 'messages', not both", param="messages",
                              code="invalid_value")
    if body.messages is None:
        return
    refuse_unsupported(body, _UNSUPPORTED_CHAT_FIELDS)
    check_tools(body.tools)


def _token_ids(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
    if ctx.tokenizer is None:
        param = "prompt" if body.prompt is not None else "messages"
        raise BadRequestError("this model has no tokenizer, so it cannot tokenize text",
                              param=param, code="invalid_value")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return ctx.tokenizer.encode(body.prompt, add_special_tokens=add_special)
    # The chat endpoint's own path, so that the ids are those /v1/chat/completions computes.
    chat = ChatCompletionRequest.model_construct(
        messages=body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)
    prompt = chat_prompt(ctx, chat)
    if not body.add_special_tokens:
        return prompt.token_ids
    return ctx.tokenizer.encode(prompt.text, add_special_tokens=True)
