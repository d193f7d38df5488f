import os
import sys

import pytest

# Test helpers live beside the tests (tiny_model.py, server_process.py).
sys.path.insert(0, os.path.dirname(__file__))

from tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(model directory, HF model) of the tiny random Llama, built once per session."""
    directory = str(tmp_path_factory.mktemp("tiny_llama"))
    return directory, make_tiny_model(directory)
