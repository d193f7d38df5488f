"""`kvtier bench multi-turn --engine in-process`: the workload on an engine in the test's process.

The report must have the server target's shape, and its counts must be what the offline LLM API
gives for the same conversations (same chat template, same tokenization, greedy replies).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from kvtier.config import EngineConfig
from kvtier.engine.llm import LLM
from kvtier.entrypoints import cli
from kvtier.entrypoints.bench import (
    REPORT_FIELDS,
    EngineTarget,
    MultiTurnConfig,
    ServerTarget,
    run_multi_turn,
)
from kvtier.entrypoints.bench.workload import build_conversations, render_completion_prompt
from kvtier.sampling_params import SamplingParams

from ...tiny_models import make_hf_model

# Tiny models on a shared 2-core machine: extra intra-op threads only spin against each other.
torch.set_num_threads(1)

CONFIG = MultiTurnConfig(num_conversations=3, num_turns=2, system_prompt_tokens=6,
                         context_tokens=2, user_tokens=3, output_tokens=4)
ENGINE_OPTIONS = dict(dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    # A byte-level tokenizer with a chat template: the benchmark sends text.
    make_hf_model("llama", directory, tokenizer="bytes")
    return str(directory)


def _expected_input_tokens(model_dir: str, config: MultiTurnConfig, api: str) -> int:
    """Prompt tokens of every turn, from the offline API replaying the conversations."""
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=config.output_tokens, ignore_eos=True)
    total = 0
    for script in build_conversations(config):
        history = [{"role": "system", "content": script.system_prompt}]
        for user_message in script.user_messages:
            history.append({"role": "user", "content": user_message})
            if api == "chat":
                (output,) = llm.chat(history, params)
            else:
                (output,) = llm.generate(render_completion_prompt(history), params)
            total += len(output.prompt_token_ids)
            history.append({"role": "assistant", "content": output.outputs[0].text})
    llm.engine.shutdown()
    return total


def _key_tree(value):
    """The report's nested key structure, values dropped."""
    if isinstance(value, dict):
        return {key: _key_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_key_tree(item) for item in value]
    return None


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_report_has_exact_counts(model_dir, api):
    target = EngineTarget(EngineConfig.create(model=model_dir, **ENGINE_OPTIONS), api=api,
                          request_timeout_s=60, run_timeout_s=120)
    report = asyncio.run(run_multi_turn(CONFIG, target, show_progress=False))
    assert tuple(report) == REPORT_FIELDS
    assert (report["label"], report["url"], report["model"], report["api"]) == \
        ("in-process", None, model_dir, api)
    assert (report["num_requests"], report["num_failed"], report["errors"]) == (6, 0, [])
    assert report["output_tokens"] == 6 * CONFIG.output_tokens
    assert report["input_tokens"] == _expected_input_tokens(model_dir, CONFIG, api)
    assert [row["count"] for row in report["ttft_by_turn_s"]] == [3, 3]
    assert 0.0 < report["ttft_s"]["p99"] <= report["latency_s"]["p99"]
    assert report["tpot_s"]["mean"] > 0.0
    # No preemption at this size: every prompt token is looked up in the prefix cache once.
    device = report["hit_rates"]["device"]
    assert device["queries"] == report["input_tokens"]
    assert 0.0 <= device["hits"] < device["queries"]


def test_report_has_the_server_targets_shape(model_dir, fake_server):
    served = asyncio.run(run_multi_turn(
        CONFIG, ServerTarget(url=fake_server.base_url, request_timeout_s=30, run_timeout_s=60),
        show_progress=False))
    in_process = asyncio.run(run_multi_turn(
        CONFIG, EngineTarget(EngineConfig.create(model=model_dir, **ENGINE_OPTIONS),
                             request_timeout_s=60, run_timeout_s=120),
        show_progress=False))
    # The fake server reports host and disk tiers as well; the tiers' own keys must match.
    tiers = served.pop("hit_rates"), in_process.pop("hit_rates")
    assert _key_tree(in_process) == _key_tree(served)
    assert _key_tree(tiers[1]["device"]) == _key_tree(tiers[0]["device"])


def test_cli_engine_options_reach_the_engine(model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "multi-turn", "--engine", "in-process", "--model", model_dir,
                     "--dtype", "float32", "--block-size", "4", "--max-num-seqs", "2",
                     "--kv-offload", "host=1MiB", "--num-conversations", "2", "--num-turns", "2",
                     "--system-prompt-tokens", "6", "--context-tokens", "2", "--user-tokens", "3",
                     "--output-tokens", "3", "--label", "cli", "--no-progress",
                     "--output-json", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert tuple(report) == REPORT_FIELDS
    assert (report["label"], report["num_requests"], report["output_tokens"]) == ("cli", 4, 12)
    # The host tier exists only because --kv-offload reached the engine; each turn-0 prompt
    # misses it (nothing was offloaded before).
    host = report["hit_rates"]["host"]
    assert host["queries"] > 0 and host["hits"] <= host["queries"]


@pytest.mark.parametrize("argv, message", [
    (["--engine", "in-process", "--kv-cache-memory-bytes", "lots"],
     "--kv-cache-memory-bytes must be a byte size"),
    (["--engine", "in-process", "--block-size", "0"], "block_size"),
    (["--engine", "in-process", "--url", "http://127.0.0.1:8000"], "--url names a server"),
    (["--engine", "in-process", "--model", "/no/such/model"], "/no/such/model"),
    (["--dtype", "float32"], "--dtype configures an in-process engine"),
    (["--kv-offload", "host=1MiB"], "--kv-offload configures an in-process engine"),
    # The in-process engine keeps no stored responses to go on from.
    (["--engine", "in-process", "--api", "responses"],
     "EngineTarget.api must be 'chat' or 'completions' (--api), got 'responses'"),
])
def test_bad_engine_argument_is_a_one_line_error(argv, message, capsys):
    assert cli.main(["bench", "multi-turn", "--no-progress", *argv]) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert err.startswith("kvtier bench: error: ") and err.count("\n") == 1
    assert message in err


def test_unknown_engine_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "multi-turn", "--engine", "gpu"])
    assert exit_info.value.code == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert "argument --engine: invalid choice: 'gpu'" in err and err.count("\n") == 1


@pytest.mark.parametrize("field, options", [
    ("engine", {"engine": "model.gguf"}),
    ("api", {"api": "responses"}),
    ("request_timeout_s", {"request_timeout_s": 0.0}),
    ("run_timeout_s", {"run_timeout_s": -1.0}),
])
def test_engine_target_names_the_bad_field(field, options):
    valid = {"engine": EngineConfig.create(model="model.gguf")}
    with pytest.raises(ValueError, match=f"EngineTarget.{field} must"):
        EngineTarget(**{**valid, **options})
