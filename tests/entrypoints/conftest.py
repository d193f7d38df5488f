import pytest

from ..tiny_models import make_hf_model
from .server_process import ServerProcess

# The names tiny_server answers to; responses carry the first.
TINY_NAMES = ("tiny", "tiny-alias")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(model directory, HF model) of the tiny random Llama with a byte-level tokenizer and a
    chat template, built once per session."""
    directory = str(tmp_path_factory.mktemp("tiny_llama"))
    return directory, make_hf_model("llama", directory, tokenizer="bytes")


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    """A `kvtier serve` process of tiny_model (64 blocks of 16 tokens, 256-token context),
    one per test module."""
    proc = ServerProcess(tiny_model[0], "--served-model-name", *TINY_NAMES,
                         "--num-device-blocks", "64", "--block-size", "16",
                         "--max-model-len", "256")
    yield proc
    proc.stop()
