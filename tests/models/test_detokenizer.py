"""IncrementalDetokenizer decodes the output after the last few prompt tokens, as vLLM does: the
text then reads as it does after the prompt (`tokenizers`' decode of prompt + output, less the
prompt's text)."""

import pytest

from kvtier.models import IncrementalDetokenizer, Tokenizer
from kvtier.models.gguf_tokenizer import tokenizer_from_gguf

from .gguf_writer import MERGES, tokens
from .sentencepiece_tokenizer import ID, sentencepiece_tokenizer

PROMPT = [ID["<s>"], ID["▁The"], ID["▁capital"], ID["▁of"], ID["▁France"], ID["▁is"]]


def deltas(tokenizer, output: list[int], prompt: list[int] = ()) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    steps = [detokenizer.step([token]) for token in output] + [detokenizer.flush()]
    assert "".join(steps) == detokenizer.text
    return steps


def after_prompt(backend, prompt: list[int], output: list[int]) -> str:
    return backend.decode(prompt + output)[len(backend.decode(prompt)):]


@pytest.fixture(scope="module")
def sentencepiece():
    backend = sentencepiece_tokenizer()
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=None)


@pytest.fixture(scope="module")
def byte_level():
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens(),
              "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.token_type": [3, 3] + [1] * 260}
    return tokenizer_from_gguf(fields, "fields")


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[-2:], PROMPT * 6])
def test_first_output_word_keeps_its_leading_space(sentencepiece, prompt):
    """Before, the output was decoded alone and the decoder's Strip took the space of
    "▁Paris": the completion read "Paris"."""
    output = [ID["▁Paris"], ID["."], ID["▁The"], ID["<0xC3>"], ID["<0xA9>"], ID["</s>"]]
    assert deltas(sentencepiece, output, prompt) == [" Paris", ".", " The", "", "é", "", ""]
    assert "".join(deltas(sentencepiece, output, prompt)) == after_prompt(
        sentencepiece.backend, prompt, output) == " Paris. Theé"


def test_without_a_prompt_the_output_decodes_alone(sentencepiece):
    assert deltas(sentencepiece, [ID["▁Paris"], ID["."]]) == ["Paris", ".", ""]


def test_prompt_ending_inside_a_character_gives_no_context(sentencepiece):
    """No suffix of the prompt decodes cleanly: the output decodes alone, its first byte as
    U+FFFD, rather than against a prompt text whose last character it changes."""
    prompt = PROMPT + [ID["<0xC3>"]]
    assert "".join(deltas(sentencepiece, [ID["<0xA9>"], ID["▁Paris"]], prompt)) == "\ufffd Paris"


@pytest.mark.parametrize("prompt_text, output_text", [
    ("hello world", " hello é世 x"),
    ("é世 hello", "世é"),
    ("x é世", "hello"),  # the 5-token suffix starts inside "é"
])
def test_byte_level_deltas_do_not_depend_on_the_prompt(byte_level, prompt_text, output_text):
    prompt = byte_level.encode(prompt_text, add_special_tokens=False)
    output = byte_level.encode(output_text, add_special_tokens=False)
    assert deltas(byte_level, output, prompt) == deltas(byte_level, output)
    assert "".join(deltas(byte_level, output, prompt)) == output_text


def test_byte_level_prompt_ending_inside_a_character_gives_no_context(byte_level):
    """The output's first byte completes the prompt's "é": it still decodes alone (U+FFFD), as
    without a prompt, and the next token's text is not lost to a misaligned prompt text."""
    e_acute = byte_level.encode("é", add_special_tokens=False)
    prompt = byte_level.encode("the capital is x", add_special_tokens=False) + e_acute[:1]
    output = e_acute[1:] + byte_level.encode("hello", add_special_tokens=False)
    assert deltas(byte_level, output, prompt) == deltas(byte_level, output) == [
        "", "\ufffdhello", ""]
