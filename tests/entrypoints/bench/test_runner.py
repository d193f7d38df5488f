"""The whole tool against the in-test OpenAI-compatible server (fake_server.py)."""

import argparse
import asyncio
import json
import socket

import pytest

from kvtier.entrypoints.bench import REPORT_FIELDS, MultiTurnConfig, ServerTarget, run_multi_turn
from kvtier.entrypoints.bench import cli as bench

from .fake_server import FIRST_TOKEN_DELAY_S, MODEL_NAME, PER_REQUEST, TOKEN_INTERVAL_S

CONFIG = MultiTurnConfig(num_conversations=3, num_turns=3, system_prompt_tokens=20,
                         context_tokens=5, user_tokens=4, output_tokens=6)


def _expected_input_words(config: MultiTurnConfig) -> int:
    # turn t: system (prefix + "Conversation i:" + context) + (t + 1) user messages + t replies
    system = config.system_prompt_tokens + 2 + config.context_tokens
    per_conversation = sum(system + (t + 1) * config.user_tokens + t * config.output_tokens
                           for t in range(config.num_turns))
    return config.num_conversations * per_conversation


def test_chat_run_reports_every_field_with_exact_counts(fake_server):
    target = ServerTarget(url=fake_server.base_url, request_timeout_s=30, run_timeout_s=60)
    report = asyncio.run(run_multi_turn(CONFIG, target, label="fake", show_progress=False))
    assert tuple(report) == REPORT_FIELDS
    assert report["model"] == MODEL_NAME
    assert (report["num_requests"], report["num_failed"], report["errors"]) == (9, 0, [])
    assert report["input_tokens"] == _expected_input_words(CONFIG) == 369
    assert report["output_tokens"] == 9 * 6
    assert report["ttft_s"]["p50"] >= FIRST_TOKEN_DELAY_S
    assert report["tpot_s"]["p50"] >= TOKEN_INTERVAL_S
    assert [row["count"] for row in report["ttft_by_turn_s"]] == [3, 3, 3]
    n = 9
    assert report["hit_rates"] == {
        "device": {"hits": 2.0 * n, "queries": 10.0 * n, "hit_rate": 0.2},
        "host": {"hits": 3.0 * n, "queries": 4.0 * n, "hit_rate": 0.75},
        "disk": {"hits": 1.0 * n, "queries": 4.0 * n, "hit_rate": 0.25},
    }
    assert PER_REQUEST["device_hits"] == 2.0


def test_history_grows_with_the_servers_replies(fake_server):
    target = ServerTarget(url=fake_server.base_url, request_timeout_s=30, run_timeout_s=60)
    asyncio.run(run_multi_turn(CONFIG, target, show_progress=False))
    last_turns = [r for r in fake_server.requests if len(r["messages"]) == 6]
    assert len(last_turns) == 3
    messages = last_turns[0]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant",
                                             "user"]
    assert messages[2]["content"] == " w0 w1 w2 w3 w4 w5"
    body = fake_server.requests[0]
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"], body["stream"]) == \
        (6, 0.0, True, True)


def test_completions_api_sends_rendered_prompts(fake_server):
    config = MultiTurnConfig(num_conversations=1, num_turns=2, system_prompt_tokens=3,
                             context_tokens=0, user_tokens=2, output_tokens=2)
    target = ServerTarget(url=fake_server.base_url, api="completions", request_timeout_s=30,
                          run_timeout_s=60)
    report = asyncio.run(run_multi_turn(config, target, show_progress=False))
    assert report["num_failed"] == 0 and report["output_tokens"] == 4
    first, second = (body["prompt"] for body in fake_server.requests)
    assert first == "System: war history guy\nConversation 0:\nUser: book thing\nAssistant:"
    assert second == first + " w0 w1\nUser: field problem\nAssistant:"


@pytest.mark.parametrize("failure, error_start", [
    ("fail_on_request_index", "BenchClientError: HTTP 500"),
    # Bug fixed in review: an in-band error event was skipped and the turn counted as a success.
    ("error_in_stream_on_request_index",
     "BenchClientError: error event in the stream: engine step failed"),
])
def test_failed_turn_ends_its_conversation(fake_server, failure, error_start):
    setattr(fake_server, failure, {0})
    config = MultiTurnConfig(num_conversations=1, num_turns=3, system_prompt_tokens=3,
                             context_tokens=0, user_tokens=2, output_tokens=2)
    target = ServerTarget(url=fake_server.base_url, request_timeout_s=30, run_timeout_s=60)
    report = asyncio.run(run_multi_turn(config, target, show_progress=False))
    assert (report["num_requests"], report["num_failed"]) == (1, 1)
    assert len(fake_server.requests) == 1
    assert report["errors"][0].startswith(error_start)
    assert report["output_tokens_per_s"] == 0.0


def test_cli_writes_json_and_png(fake_server, tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([
        "multi-turn", "--url", fake_server.base_url, "--num-conversations", "2",
        "--num-turns", "2", "--system-prompt-tokens", "10", "--context-tokens", "3",
        "--user-tokens", "2", "--output-tokens", "3", "--label", "cli", "--no-progress",
        "--output-json", str(tmp_path / "out.json"), "--output-plot", str(tmp_path / "out.png")])
    assert bench.run(args) == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert tuple(report) == REPORT_FIELDS
    assert (report["label"], report["num_requests"], report["output_tokens"]) == ("cli", 4, 12)
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_think_time_separates_turns(fake_server):
    config = MultiTurnConfig(num_conversations=1, num_turns=2, system_prompt_tokens=3,
                             context_tokens=0, user_tokens=2, output_tokens=2, think_time_s=0.3)
    target = ServerTarget(url=fake_server.base_url, request_timeout_s=30, run_timeout_s=60)
    asyncio.run(run_multi_turn(config, target, show_progress=False))
    first, second = fake_server.arrival_times
    # the first reply takes FIRST_TOKEN_DELAY_S + TOKEN_INTERVAL_S, then the think time
    assert second - first >= 0.3 + FIRST_TOKEN_DELAY_S + TOKEN_INTERVAL_S


def test_start_interval_spreads_the_first_turns(fake_server):
    config = MultiTurnConfig(num_conversations=3, num_turns=1, system_prompt_tokens=3,
                             context_tokens=2, user_tokens=2, output_tokens=2,
                             start_interval_s=0.25)
    target = ServerTarget(url=fake_server.base_url, request_timeout_s=30, run_timeout_s=60)
    report = asyncio.run(run_multi_turn(config, target, show_progress=False))
    first, second, third = sorted(fake_server.arrival_times)
    # conversation i sleeps i * 0.25 s from the same start; arrivals jitter by milliseconds
    assert second - first >= 0.2 and third - second >= 0.2 and third - first >= 0.45
    assert report["workload"]["start_interval_s"] == 0.25


def test_server_without_metrics_reports_no_hit_rates(fake_server):
    fake_server.metrics_enabled = False
    config = MultiTurnConfig(num_conversations=1, num_turns=1, system_prompt_tokens=3,
                             context_tokens=0, user_tokens=2, output_tokens=2)
    target = ServerTarget(url=fake_server.base_url, request_timeout_s=30, run_timeout_s=60)
    report = asyncio.run(run_multi_turn(config, target, show_progress=False))
    assert (report["num_failed"], report["hit_rates"]) == (0, {})


def test_cli_reports_an_unreachable_server_in_one_line(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with socket.socket() as sock:  # a port that was free a moment ago; nothing listens on it
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    args = parser.parse_args(["multi-turn", "--url", url, "--no-progress",
                              "--request-timeout", "5"])
    assert bench.run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier bench multi-turn: error: cannot list models at {url}/v1/models")


def test_request_past_its_deadline_is_a_failed_turn(fake_server):
    # Each reply takes FIRST_TOKEN_DELAY_S + 49 * TOKEN_INTERVAL_S = 0.54 s, past 0.3 s.
    config = MultiTurnConfig(num_conversations=1, num_turns=2, system_prompt_tokens=3,
                             context_tokens=0, user_tokens=2, output_tokens=50)
    target = ServerTarget(url=fake_server.base_url, request_timeout_s=0.3, run_timeout_s=60)
    report = asyncio.run(run_multi_turn(config, target, show_progress=False))
    assert (report["num_requests"], report["num_failed"]) == (1, 1)
    assert report["errors"] == ["TimeoutError: no complete reply in 0.3 s"]
