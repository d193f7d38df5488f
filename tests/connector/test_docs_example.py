"""The worked example of docs/connectors.md runs as written, loaded by kv_connector_module_path."""

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("kvtier.engine.llm",
                    reason="the engine (kvtier/engine/llm.py) is not built yet")

from kvtier import LLM, SamplingParams  # noqa: E402

from ..tiny_models import make_block_prompts, make_hf_model  # noqa: E402
from .connector_testing import BLOCK_SIZE, MAX_TOKENS  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "connectors.md"


def example_source() -> str:
    blocks = re.findall(r"```python\n(# my_connectors\.py\n.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 1, "docs/connectors.md must hold one `# my_connectors.py` block"
    return blocks[0]


@pytest.fixture
def my_connectors(tmp_path, monkeypatch):
    (tmp_path / "my_connectors.py").write_text(example_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_connectors", None)


def test_the_memory_connector_reuses_another_engines_prefill(my_connectors, tmp_path):
    model_dir = str(tmp_path / "model")
    make_hf_model("llama", model_dir)
    prompts = [{"prompt_token_ids": p} for p in make_block_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    config = {"kv_connector": "MemoryConnector", "kv_connector_module_path": "my_connectors"}

    def run(**options):
        llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_device_blocks=64,
                  **options)
        outputs = llm.generate(prompts, params)
        llm.engine.check_invariants()
        llm.engine.shutdown()
        return outputs

    plain = run()
    first = run(kv_transfer_config=config)
    second = run(kv_transfer_config=config)
    tokens = [out.outputs[0].token_ids for out in plain]
    assert [out.outputs[0].token_ids for out in first] == tokens
    assert [out.outputs[0].token_ids for out in second] == tokens
    # Prompts of 19, 16, 13, 23 and 6 tokens; the third shares 12 tokens with the first.
    assert [out.num_cached_tokens for out in first] == [0, 0, 12, 0, 0]
    assert [out.num_cached_tokens for out in second] == [16, 12, 12, 20, 4]
    assert len(sys.modules["my_connectors"].STORE) == 4 + 4 + 0 + 5 + 1
