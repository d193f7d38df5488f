"""Completion prompts in OpenAI's four forms, checked before the engine sees them, and chat
prompts as the template renders them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.prompts import (
    chat_prompt,
    check_text,
    completion_prompts,
    prompt_chars,
)
from kvtier.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.models.tokenizer import Tokenizer

VOCAB = 100
CTX = SimpleNamespace(vocab_size=VOCAB, tokenizer=None)


def test_token_id_prompts_pass_as_they_are():
    one = completion_prompts(CTX, [0, 5, VOCAB - 1])
    assert [p.token_ids for p in one] == [[0, 5, VOCAB - 1]] and one[0].text is None
    several = completion_prompts(CTX, [[1, 2], [3]])
    assert [p.token_ids for p in several] == [[1, 2], [3]]


@pytest.mark.parametrize("prompt, param, bad", [
    ([1, VOCAB, 2, -1], "prompt", VOCAB),  # the first bad id is named
    ([1, -3, 2], "prompt", -3),
    ([[1, 2], [3, 10**9]], "prompt[1]", 10**9),
])
def test_an_id_outside_the_vocabulary_is_a_400_naming_it(prompt, param, bad):
    with pytest.raises(BadRequestError) as info:
        completion_prompts(CTX, prompt)
    assert info.value.param == param
    assert info.value.message == (f"{param} holds token id {bad}, outside the vocabulary "
                                  f"[0, {VOCAB})")


@pytest.mark.parametrize("prompt, chars", [
    ("hello", 5), (["ab", "cde"], 5), ([1, 2, 3], 0), ([[1, 2], [3]], 0), ([], 0)])
def test_prompt_chars_counts_text_only(prompt, chars):
    assert prompt_chars(prompt) == chars


def test_a_lone_surrogate_is_found_in_a_list_of_texts_not_mistaken_in_token_ids():
    check_text(CompletionRequest.model_validate({"model": "m", "prompt": list(range(50))}))
    body = CompletionRequest.model_validate({"model": "m", "prompt": ["fine", "bad \ud800"]})
    with pytest.raises(BadRequestError) as info:
        check_text(body)
    assert info.value.param == "prompt[1]"


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_model):
    return Tokenizer.from_hf_dir(tiny_model[0])


def _chat(tokenizer, template: str | None = None, **fields):
    if template is not None:
        tokenizer = Tokenizer(tokenizer.backend, bos_token=None, eos_token=None,
                              chat_template=template)
    ctx = SimpleNamespace(vocab_size=tokenizer.vocab_size, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "It is "}]
    return chat_prompt(ctx, ChatCompletionRequest.model_validate(
        {"messages": messages, "add_generation_prompt": False, **fields}))


def test_continue_final_message_leaves_the_last_message_open(byte_tokenizer):
    closed = _chat(byte_tokenizer)
    open_ = _chat(byte_tokenizer, continue_final_message=True)
    assert open_.text.endswith("assistant\nIt is")  # the template's closing tokens dropped
    assert closed.text == open_.text + " <|im_end|>\n"
    assert closed.token_ids[:len(open_.token_ids)] == open_.token_ids


def test_continue_final_message_needs_the_text_in_the_rendered_chat(byte_tokenizer):
    with pytest.raises(BadRequestError) as info:
        _chat(byte_tokenizer, "{% for m in messages %}{{ m['role'] }}{% endfor %}",
              continue_final_message=True)
    assert info.value.param == "continue_final_message"


def test_chat_template_kwargs_reach_the_template_but_not_its_own_names(byte_tokenizer):
    template = "{% if think %}<think>{% endif %}{% for m in messages %}{{ m['content'] }}" \
               "{% endfor %}"
    assert _chat(byte_tokenizer, template, chat_template_kwargs={"think": True}).text == \
        "<think>HiIt is "
    assert _chat(byte_tokenizer, template).text == "HiIt is "
    with pytest.raises(BadRequestError) as info:
        _chat(byte_tokenizer, template, chat_template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"


def test_message_chars_counts_tools_and_tool_calls_too():
    # What decides whether a chat is rendered off the event loop: all the text it renders.
    from kvtier.entrypoints.openai.prompts import PER_MESSAGE_CHARS, message_chars
    from kvtier.entrypoints.openai.protocol import ChatMessage

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "x" * 500}}
    messages = [ChatMessage(role="assistant", content=None, tool_calls=[call]),
                ChatMessage(role="user", content="hi")]
    tools = [{"type": "function", "function": {"name": "g", "description": "y" * 1000}}]
    assert message_chars(messages) > 500
    assert message_chars(messages, tools) > 1500
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert message_chars([ChatMessage(role="user", content="z", extra=deep)]) == \
        len("zextra") + PER_MESSAGE_CHARS
    # However empty, many messages render for long: each counts for a short text.
    assert message_chars([ChatMessage(role="user", content="")] * 1000) == 1000 * PER_MESSAGE_CHARS


def test_a_text_part_without_text_is_a_400_naming_its_text(byte_tokenizer):
    ctx = SimpleNamespace(vocab_size=byte_tokenizer.vocab_size, tokenizer=byte_tokenizer)
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text"}]}]})
    with pytest.raises(BadRequestError) as info:
        chat_prompt(ctx, request)
    assert (info.value.param, info.value.code) == ("messages[0].content[1].text",
                                                   "missing_required_parameter")
    assert "type" not in info.value.message  # once "content part type 'text' is not supported"


@pytest.fixture(scope="module")
def bos_tokenizer(byte_tokenizer):
    """The byte tokenizer, adding a BOS (<|endoftext|>, id 256) with its special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_str(byte_tokenizer.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 256)])
    return Tokenizer(backend, bos_token="<|endoftext|>", eos_token=None,
                     chat_template=byte_tokenizer.chat_template)


def test_add_special_tokens_adds_the_bos_or_leaves_it_out_as_vllm(bos_tokenizer):
    ctx = SimpleNamespace(vocab_size=bos_tokenizer.vocab_size, tokenizer=bos_tokenizer)
    plain = bos_tokenizer.encode("ab", add_special_tokens=False)
    assert completion_prompts(ctx, "ab")[0].token_ids == [256, *plain]
    assert completion_prompts(ctx, "ab", add_special_tokens=False)[0].token_ids == plain
    messages = {"messages": [{"role": "user", "content": "Hi"}]}
    templated = chat_prompt(ctx, ChatCompletionRequest.model_validate(messages))
    assert templated.token_ids[0] != 256  # the template writes the chat's special tokens
    added = chat_prompt(ctx, ChatCompletionRequest.model_validate(
        {**messages, "add_special_tokens": True}))
    assert added.token_ids == [256, *templated.token_ids]
