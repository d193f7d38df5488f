"""`kvtier bench trace` against an in-process engine on a tiny model: exact prefix hits, the
trace's output lengths, arrivals on the trace's clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from kvtier.config import EngineConfig
from kvtier.entrypoints import cli
from kvtier.entrypoints.bench import EngineTarget
from kvtier.entrypoints.bench.trace import TraceScaling, load_trace, scale_trace
from kvtier.entrypoints.bench.trace_runner import (
    TRACE_REPORT_FIELDS,
    TraceReplayConfig,
    run_trace,
)

from ...tiny_models import make_hf_model

torch.set_num_threads(1)

TINY_TRACE = Path(__file__).parent / "data" / "tiny_trace.jsonl"
BLOCK_SIZE = 4
TOKENS_PER_BLOCK = 8  # a multiple of BLOCK_SIZE: trace blocks are whole engine blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    make_hf_model("llama", directory)  # token-id prompts: no tokenizer needed
    return str(directory)


def expected_device_hits(tokens_per_block: int, block_size: int) -> list[int]:
    """Per request: its longest prefix of hash ids that earlier requests held as full blocks,
    in tokens, capped where the engine caps a hit (whole blocks, last prompt token recomputed).
    """
    seen: set[tuple[int, ...]] = set()
    hits = []
    for request in scale_trace(load_trace(TINY_TRACE), TraceScaling(tokens_per_block)):
        ids = request.hash_ids
        prefix = 0
        while prefix < len(ids) and ids[:prefix + 1] in seen:
            prefix += 1
        cap = (request.num_prompt_tokens - 1) // block_size * block_size
        hits.append(min(prefix * tokens_per_block, cap))
        num_full = request.num_prompt_tokens // tokens_per_block
        seen.update(ids[:n] for n in range(1, num_full + 1))
    return hits


def _target(model_dir: str) -> EngineTarget:
    engine = EngineConfig.create(model=model_dir, dtype="float32", block_size=BLOCK_SIZE)
    return EngineTarget(engine, api="completions", request_timeout_s=60, run_timeout_s=120)


def test_one_at_a_time_replay_hits_exactly_the_shared_prefixes(model_dir):
    # By hand: 0, [0,1] -> 16, [0,1,2] -> 24, 0, [0,1,2] of a 24-token prompt -> 20 (last token
    # recomputed), [0] -> 8.
    expected = expected_device_hits(TOKENS_PER_BLOCK, BLOCK_SIZE)
    assert expected == [0, 16, 24, 0, 20, 8]
    config = TraceReplayConfig(TINY_TRACE, TraceScaling(TOKENS_PER_BLOCK, time_scale=0.0),
                               max_concurrency=1)
    report = asyncio.run(run_trace(config, _target(model_dir), show_progress=False))
    assert tuple(report) == TRACE_REPORT_FIELDS
    assert (report["num_requests"], report["num_failed"], report["errors"]) == (6, 0, [])
    assert report["input_tokens"] == 24 + 24 + 28 + 5 + 24 + 10
    assert report["output_tokens"] == 3 + 2 + 5 + 1 + 40 + 2  # ignore_eos: the trace's lengths
    device = report["hit_rates"]["device"]
    assert (device["hits"], device["queries"]) == (sum(expected), report["input_tokens"])
    assert report["scaling"]["tokens_per_block"] == TOKENS_PER_BLOCK
    rows = report["requests"]
    # One at a time: each request starts after the one before it finished.
    for before, after in zip(rows, rows[1:], strict=False):
        assert after["start_s"] >= before["start_s"] + before["latency_s"]


def test_arrivals_follow_the_scaled_clock_without_waiting(model_dir):
    config = TraceReplayConfig(TINY_TRACE, TraceScaling(TOKENS_PER_BLOCK, time_scale=2.0,
                                                        max_requests=5))
    report = asyncio.run(run_trace(config, _target(model_dir), show_progress=False))
    rows = report["requests"]
    assert [row["arrival_s"] for row in rows] == [0.0, 0.2, 0.4, 0.6, 0.8]
    for row in rows:
        assert row["arrival_s"] <= row["start_s"] < row["arrival_s"] + 0.15
    assert report["duration_s"] >= 0.8
    assert report["num_failed"] == 0 and report["output_tokens"] == 3 + 2 + 5 + 1 + 40


def test_open_loop_sends_while_earlier_requests_run(model_dir, tmp_path):
    trace = tmp_path / "burst.jsonl"
    # Both at once; the first decodes 60 tokens, so the second starts while it runs.
    trace.write_text(
        '{"timestamp": 0, "input_length": 512, "output_length": 60, "hash_ids": [0]}\n'
        '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    config = TraceReplayConfig(trace, TraceScaling(TOKENS_PER_BLOCK))
    report = asyncio.run(run_trace(config, _target(model_dir), show_progress=False))
    first, second = report["requests"]
    assert second["start_s"] < first["start_s"] + first["latency_s"]
    assert second["start_s"] + second["latency_s"] < first["start_s"] + first["latency_s"]


def test_cli_writes_report_and_plot(model_dir, tmp_path, capsys):
    out, plot = tmp_path / "trace.json", tmp_path / "trace.png"
    code = cli.main(["bench", "trace", "--trace", str(TINY_TRACE), "--engine", "in-process",
                     "--model", model_dir, "--dtype", "float32", "--block-size", "4",
                     "--tokens-per-block", "8", "--time-scale", "0", "--max-concurrency", "1",
                     "--max-output-tokens", "3", "--no-progress", "--label", "tiny",
                     "--output-json", str(out), "--output-plot", str(plot)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "8 tokens per hash id" in captured.err
    report = json.loads(out.read_text())
    assert (report["label"], report["output_tokens"]) == ("tiny", 3 + 2 + 3 + 1 + 3 + 2)
    assert report["hit_rates"]["device"]["hits"] == sum(expected_device_hits(8, 4))
    assert plot.stat().st_size > 0


def test_cli_rejects_a_server_run_without_vocab_size(capsys):
    code = cli.main(["bench", "trace", "--trace", str(TINY_TRACE), "--url",
                     "http://127.0.0.1:9", "--model", "m", "--no-progress"])
    assert code == cli.USAGE_ERROR
    assert "pass --vocab-size" in capsys.readouterr().err
