"""The grammar compiler alone: what each constraint and option compiles to, checked by the
tokens its mask allows (the default model's tokenizer is not needed: a byte-level one)."""

import pytest
import torch
from tokenizers import Tokenizer

from kvtier.models.tokenizer import Tokenizer as KvtierTokenizer
from kvtier.sampling_params import SamplingParams, StructuredOutputsParams
from kvtier.structured_output import GrammarCompiler, GrammarError, apply_grammar_masks

from ..tiny_models import BYTE_EOS_ID, BYTE_VOCAB, save_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bytes")
    save_byte_tokenizer(directory)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    wrapped = KvtierTokenizer(tokenizer, bos_token=None, eos_token="<|im_end|>",
                              chat_template=None)
    return GrammarCompiler(wrapped, BYTE_VOCAB, [BYTE_EOS_ID])


def allowed_texts(tokenizer, grammar) -> set[str]:
    """The decoded tokens the grammar allows next."""
    logits = apply_grammar_masks(torch.zeros(1, BYTE_VOCAB), [grammar])[0]
    ids = torch.isfinite(logits).nonzero()[:, 0].tolist()
    return {"EOS" if i == BYTE_EOS_ID else tokenizer.decode([i]) for i in ids}


def feed(tokenizer, grammar, text: str) -> None:
    for token in tokenizer.encode(text).ids:
        assert grammar.accept(token), text


def test_whitespace_is_flexible_unless_disabled(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    flexible = compiler.compile(StructuredOutputsParams(json=schema))
    strict = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    for grammar in (flexible, strict):
        feed(tokenizer, grammar, "{")
    assert " " in allowed_texts(tokenizer, flexible)
    assert allowed_texts(tokenizer, strict) == {'"'}


def test_additional_properties_are_closed_only_when_asked(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    open_grammar = compiler.compile(StructuredOutputsParams(json=schema,
                                                            disable_any_whitespace=True))
    closed = compiler.compile(StructuredOutputsParams(
        json=schema, disable_any_whitespace=True, disable_additional_properties=True))
    for grammar in (open_grammar, closed):
        feed(tokenizer, grammar, '{"a":1')
    assert "," in allowed_texts(tokenizer, open_grammar)
    assert allowed_texts(tokenizer, closed) <= set("0123456789}")
    assert schema == {"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["a"]}  # the caller's schema is left as it was


def test_a_nested_object_is_closed_too(compiler, tokenizer):
    schema = {"type": "object", "properties": {"inner": {"type": "array", "items": {
        "type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}}},
        "required": ["inner"]}
    closed = compiler.compile(StructuredOutputsParams(
        json=schema, disable_any_whitespace=True, disable_additional_properties=True))
    feed(tokenizer, closed, '{"inner":[{"b":true')
    assert allowed_texts(tokenizer, closed) == {"}"}


def test_json_object_allows_any_object_and_ends_with_eos(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(json_object=True,
                                                       disable_any_whitespace=True))
    assert allowed_texts(tokenizer, grammar) == {"{"}
    feed(tokenizer, grammar, '{"x":[1,"y",null]}')
    assert allowed_texts(tokenizer, grammar) == {"EOS"}
    assert grammar.accept(BYTE_EOS_ID)


def test_gbnf_and_lark_grammars_both_compile(compiler, tokenizer):
    for text in ('root ::= "ab" | "cd"', 'start: "ab" | "cd"'):
        grammar = compiler.compile(StructuredOutputsParams(grammar=text))
        assert allowed_texts(tokenizer, grammar) == {"a", "c"}


def test_copies_advance_apart(compiler, tokenizer):
    first = compiler.compile(StructuredOutputsParams(choice=["ab", "cd"]))
    second = first.copy()
    feed(tokenizer, first, "a")
    assert allowed_texts(tokenizer, first) == {"b"}
    assert allowed_texts(tokenizer, second) == {"a", "c"}


def test_a_refused_token_says_why(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(choice=["ab"]))
    bad = tokenizer.encode("z").ids[0]
    assert not grammar.accept(bad)
    assert grammar.why_refused(bad).startswith(f"token {bad} breaks the structured output")
    assert "\n" not in grammar.why_refused(bad)


def test_a_model_without_a_tokenizer_is_refused():
    compiler = GrammarCompiler(None, BYTE_VOCAB, [BYTE_EOS_ID])
    with pytest.raises(GrammarError, match="needs the model's tokenizer"):
        compiler.compile(StructuredOutputsParams(regex="a"))


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"grammar": "  "}, "grammar must be a non-empty string"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace"),
    ({"regex": "a", "bogus": 1}, "unknown fields \\['bogus'\\]"),
])
def test_bad_params_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=fields)


def test_a_grammar_may_start_after_a_token(compiler, tokenizer):
    grammar = compiler.compile(StructuredOutputsParams(choice=["ab"]))
    grammar.starts_after = BYTE_EOS_ID - 1  # any token id: the end of a model's thinking
    def num_allowed(grammar) -> int:
        return int(torch.isfinite(apply_grammar_masks(torch.zeros(1, BYTE_VOCAB),
                                                      [grammar])).sum())

    assert num_allowed(grammar) == BYTE_VOCAB  # nothing masked yet
    copy = grammar.copy()
    assert grammar.accept(tokenizer.encode("z").ids[0])  # free text before the start
    assert grammar.accept(BYTE_EOS_ID - 1)
    assert allowed_texts(tokenizer, grammar) == {"a"}
    assert not copy.active and num_allowed(copy) == BYTE_VOCAB


def test_the_last_token_can_be_taken_back(compiler, tokenizer):
    # The scheduler drops a step's token whose KV read failed: the grammar steps back too.
    grammar = compiler.compile(StructuredOutputsParams(choice=["ab", "cd"]))
    assert grammar.accept(tokenizer.encode("a").ids[0])
    grammar.undo_last()
    assert allowed_texts(tokenizer, grammar) == {"a", "c"}
    waiting = compiler.compile(StructuredOutputsParams(choice=["ab"]))
    waiting.starts_after = BYTE_EOS_ID - 1
    assert waiting.accept(BYTE_EOS_ID - 1) and waiting.active
    waiting.undo_last()
    assert not waiting.active and waiting.starts_after == BYTE_EOS_ID - 1


def test_choices_are_literal_and_many_of_them_compile(compiler, tokenizer):
    tricky = ["a.b", "(x|y)*", "[z]", "\\\\", "$^"]
    for choice in tricky:
        grammar = compiler.compile(StructuredOutputsParams(choice=tricky))
        feed(tokenizer, grammar, choice)
        assert "EOS" in allowed_texts(tokenizer, grammar)
    dot = compiler.compile(StructuredOutputsParams(choice=["a.b"]))
    feed(tokenizer, dot, "a")
    assert allowed_texts(tokenizer, dot) == {"."}  # a literal dot, not any character
    many = [f"option {i}" for i in range(5000)]  # past llguidance's 2,000-item grammar row
    grammar = compiler.compile(StructuredOutputsParams(choice=many))
    feed(tokenizer, grammar, "option 4321")
    assert allowed_texts(tokenizer, grammar) == {"EOS"}
