"""Structured outputs: grammars that decide which tokens may come next, on llguidance."""

from kvtier.structured_output.grammar import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputGrammar,
)
from kvtier.structured_output.masks import apply_grammar_masks

__all__ = ["GrammarCompiler", "GrammarError", "StructuredOutputGrammar", "apply_grammar_masks"]
