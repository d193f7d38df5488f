"""Compiling a request's StructuredOutputsParams into a grammar matcher, and the matcher's
per-request state.

llguidance (a Rust library) does the work: it compiles JSON schemas, regular expressions, Lark
or GBNF grammars and choices against the model's tokenizer, computes each step's mask of the
tokens that keep the output inside the grammar, and bounds its own work per step (its parser
limits), so one request's grammar cannot stall the batch. Once the output is complete, the
mask allows only the model's EOS tokens; sampling one ends the request as any EOS does.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance

from kvtier.models.tokenizer import Tokenizer
from kvtier.sampling_params import StructuredOutputsParams

# JSON schema keywords whose values map names to subschemas, and those whose value is one
# subschema or a list of them: where disable_additional_properties looks for objects.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "contains", "not", "if", "then",
               "else", "allOf", "anyOf", "oneOf", "propertyNames", "additionalProperties",
               "unevaluatedProperties", "unevaluatedItems")


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


class GrammarError(ValueError):
    """A structured outputs constraint that does not compile. The message names the
    SamplingParams field; `problem` says what is wrong without naming one, for an API whose
    client gave the constraint in a field of its own (OpenAI's response_format)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"SamplingParams.{field} {problem}")
        self.problem = problem


class StructuredOutputGrammar:
    """One completion's place in its grammar. Not thread safe: the engine thread alone
    advances it (one sampled token per step).

    A grammar may start only after a given token (`starts_after`): a reasoning model's answer
    is held to it once its reasoning has ended, the thinking before that runs free."""

    def __init__(self, matcher: llguidance.LLMatcher, starts_after: int | None = None) -> None:
        self._matcher = matcher
        # The token whose sampling starts the grammar; None: it holds from the first token.
        self.starts_after = starts_after
        # Whether the output was complete before the last token came (then only EOS fits).
        self._ended_before = False
        # What the last accepted token did: "matched", "started" (it was starts_after), or
        # None (nothing to undo).
        self._last: str | None = None
        self._started_by = starts_after

    def copy(self) -> StructuredOutputGrammar:
        """A grammar at the same place with its own state (each of n completions has one)."""
        return StructuredOutputGrammar(self._matcher.deep_copy(), self.starts_after)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    @property
    def active(self) -> bool:
        """Whether it holds the next token."""
        return self.starts_after is None

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the grammar
        is then in an error state for good)."""
        if not self.active:
            self._last = None
            if token_id == self.starts_after:
                self.starts_after, self._last = None, "started"
                self._started_by = token_id
            return True
        self._ended_before = self._matcher.is_stopped()
        accepted = self._matcher.consume_token(token_id)
        self._last = "matched" if accepted else None
        return accepted

    def undo_last(self) -> None:
        """Take back the last accepted token: the scheduler dropped it (its step read KV that
        failed to load, and the request computes again from before it)."""
        if self._last == "matched":
            self._matcher.rollback(1)
        elif self._last == "started":
            self.starts_after = self._started_by
        self._last = None

    def why_refused(self, token_id: int) -> str:
        """Why `accept(token_id)` returned False, in one line."""
        if self._ended_before:
            return (f"token {token_id} came after the output was complete under the structured "
                    "output grammar, which then allows only EOS (min_tokens or ignore_eos "
                    "forbade it?)")
        error = (self._matcher.get_error() or "").strip().splitlines()
        detail = error[0] if error else ("min_tokens, allowed_token_ids or bad_words forbade "
                                         "every token it allows next?")
        return f"token {token_id} breaks the structured output grammar: {detail}"


class GrammarCompiler:
    """Compiles constraints against one model's tokenizer. Thread safe: the server compiles
    on worker threads while the engine thread steps."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """GrammarError naming the field if the constraint is invalid."""
        where = f"structured_outputs.{params.kind}"
        try:
            grammar = _llguidance_grammar(params)
        except RecursionError:
            raise GrammarError(where, "is invalid: nested too deeply") from None
        except ValueError as exc:
            raise GrammarError(where, f"is invalid: {exc}") from None
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(where, f"is invalid: {matcher.get_error().strip()}")
        # The grammar's first mask builds its lexer states (~0.2 s for a schema of 10,000
        # properties): here, off the engine thread, whose first mask then takes under 1 ms.
        # Computing a mask leaves the matcher where it is.
        matcher.compute_bitmask()
        if matcher.is_error():  # some grammars fail only at their first mask
            raise GrammarError(where, f"is invalid: {matcher.get_error().strip()}")
        return StructuredOutputGrammar(matcher)

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first compile (~0.2 s for a 49k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise GrammarError("structured_outputs", "needs the model's tokenizer; "
                                       "this model has none")
                if not self._eos_token_ids:
                    raise GrammarError("structured_outputs", "needs an EOS token to end the "
                                       "output; this model names none")
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                    eos_token=self._eos_token_ids)
            return self._ll_tokenizer


def _llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (ValueError for one that does not parse)."""
    if params.json is not None or params.json_object:
        schema: Any = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        if params.disable_additional_properties:
            schema = _without_additional_properties(copy.deepcopy(schema))
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if params.regex is not None:
        return llguidance.grammar_from("regex", params.regex)
    if params.choice is not None:
        # As one regex of literal alternatives: llguidance's own choice grammar puts them in
        # one grammar row, which fails at its first step past 2,000 of them.
        return llguidance.grammar_from(
            "regex", "(?:" + "|".join(_regex_literal(c) for c in params.choice) + ")")
    return llguidance.grammar_from("grammar", params.grammar)


def _regex_literal(text: str) -> str:
    """`text` as a regex matching just itself (the regex crate's metacharacters escaped)."""
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def _without_additional_properties(schema: Any) -> Any:
    """Every object schema with properties but no additionalProperties gets
    `additionalProperties: false` (in place; returns `schema`)."""
    if isinstance(schema, list):
        for item in schema:
            _without_additional_properties(item)
        return schema
    if not isinstance(schema, dict):
        return schema
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for subschema in schema[key].values():
                _without_additional_properties(subschema)
    for key in _SUBSCHEMAS:
        _without_additional_properties(schema.get(key))
    has_properties = any(isinstance(schema.get(k), dict)
                         for k in ("properties", "patternProperties"))
    if has_properties and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema
