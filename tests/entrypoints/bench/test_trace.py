"""Trace loading, scaling and the token ids that stand for hash ids (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.entrypoints.bench.trace import (
    BlockTokens,
    TraceFormatError,
    TraceScaling,
    load_trace,
    scale_trace,
)

TINY_TRACE = Path(__file__).parent / "data" / "tiny_trace.jsonl"


def test_load_reads_every_line():
    requests = load_trace(TINY_TRACE)
    assert [r.hash_ids for r in requests] == [(0, 1, 2), (0, 1, 3), (0, 1, 2, 4), (5,),
                                              (0, 1, 2), (0, 7)]
    assert [r.timestamp_ms for r in requests] == [0, 100, 200, 300, 400, 500]
    assert requests[2].input_length == 1792


def test_scaling_options_do_what_they_say():
    requests = load_trace(TINY_TRACE)
    scaled = scale_trace(requests, TraceScaling(tokens_per_block=8, time_scale=0.5,
                                                max_requests=5, max_output_tokens=4))
    assert len(scaled) == 5
    assert [r.arrival_s for r in scaled] == [0.0, 0.05, 0.1, 0.15, 0.2]
    # Full blocks: 8 tokens each; a partial last block its share (256/512 -> 4, 300/512 -> 5).
    assert [r.num_prompt_tokens for r in scaled] == [24, 24, 28, 5, 24]
    # Capped at 4; the trace's 0 becomes 1 (max_tokens must be >= 1).
    assert [r.output_tokens for r in scaled] == [3, 2, 4, 1, 4]
    unscaled = scale_trace(requests, TraceScaling())
    assert [r.num_prompt_tokens for r in unscaled] == [r.input_length for r in requests]
    assert [r.output_tokens for r in unscaled] == [3, 2, 5, 1, 40, 2]
    assert unscaled[-1].arrival_s == 0.5


def test_first_request_starts_the_slice_and_its_clock():
    requests = load_trace(TINY_TRACE)
    scaled = scale_trace(requests, TraceScaling(first_request=2, max_requests=3))
    assert [r.hash_ids for r in scaled] == [(0, 1, 2, 4), (5,), (0, 1, 2)]
    assert [r.arrival_s for r in scaled] == [0.0, 0.1, 0.2]
    assert [r.index for r in scaled] == [0, 1, 2]
    assert "from request 2" in TraceScaling(first_request=2).describe()
    with pytest.raises(ValueError, match="first_request 6 is past the trace's 6 requests"):
        scale_trace(requests, TraceScaling(first_request=6))
    with pytest.raises(ValueError, match="first_request must be >= 0"):
        TraceScaling(first_request=-1)


def test_same_hash_ids_give_the_same_tokens_in_any_order():
    scaled = scale_trace(load_trace(TINY_TRACE), TraceScaling(tokens_per_block=8))
    forward = BlockTokens(8, vocab_size=128)
    backward = BlockTokens(8, vocab_size=128)
    prompts = [forward.prompt(r) for r in scaled]
    assert [backward.prompt(r) for r in reversed(scaled)] == list(reversed(prompts))
    assert prompts[0] == prompts[4]
    assert prompts[2][:24] == prompts[0]
    assert prompts[1][:16] == prompts[0][:16] and prompts[1][16:] != prompts[0][16:]
    assert [len(p) for p in prompts] == [r.num_prompt_tokens for r in scaled]
    assert all(0 <= t < 128 for p in prompts for t in p)
    assert len({t for p in prompts for t in p}) > 20  # drawn, not constant
    assert BlockTokens(8, 128, seed=1).prompt(scaled[0]) != prompts[0]


def test_malformed_lines_are_named(tmp_path):
    cases = {
        '{"timestamp": 0, "input_length": 10}': "line 1: not a trace record",
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}':
            "input_length 600 does not fit 1 hash ids",
        '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}':
            "hash_ids is empty",
        '{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}':
            "must be >= 0",
        # JSON's NaN and Infinity parse; as arrival times they stalled or hung a replay.
        '{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [0]}':
            "timestamp must be a finite number",
        '{"timestamp": Infinity, "input_length": 10, "output_length": 1, "hash_ids": [0]}':
            "timestamp must be a finite number",
        # Each of these was converted to other hash ids or lengths, silently.
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "12"}':
            "hash_ids must be a list of integers",
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0.7]}':
            "hash_ids must hold integers, got 0.7",
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [true]}':
            "hash_ids must hold integers, got True",
        '{"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [0]}':
            "input_length must hold integers",
        '{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}':
            "input_length must hold integers",
        '[1, 2]': "not a trace record",
    }
    for line, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(line + "\n")
        with pytest.raises(TraceFormatError, match=message):
            load_trace(path)
    with pytest.raises(TraceFormatError, match="holds no request"):
        (tmp_path / "empty.jsonl").write_text("\n")
        load_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(TraceFormatError, match="cannot read the trace .*binary.jsonl"):
        load_trace(tmp_path / "binary.jsonl")


def test_scaling_rejects_bad_values():
    with pytest.raises(ValueError, match="tokens_per_block must be >= 1"):
        TraceScaling(tokens_per_block=0)
    with pytest.raises(ValueError, match="time_scale must be a finite number >= 0"):
        TraceScaling(time_scale=-1.0)
    with pytest.raises(ValueError, match="max_output_tokens"):
        TraceScaling(max_output_tokens=0)


def test_describe_states_the_scaling():
    line = TraceScaling(tokens_per_block=16, time_scale=0.25, max_output_tokens=8).describe()
    assert "16 tokens per hash id" in line and "x0.03125" in line
    assert "inter-arrival times x0.25" in line and "capped at 8" in line
