"""`kvtier bench multi-turn` against a real `kvtier serve` with a tiny random-weight model.

The short form of the issue 7 benchmark: two conversations, two turns, through the CLI the
users run. The numbers mean nothing here; the test asserts the JSON has every field, that no
request failed and that the token counts are what the server reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.entrypoints.bench import REPORT_FIELDS

from ...tiny_models import make_hf_model
from ..server_process import REPO_ROOT, ServerProcess


@pytest.fixture
def kvtier_server(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    # A byte-level tokenizer: the benchmark sends text.
    make_hf_model("llama", model_dir, tokenizer="bytes")
    server = ServerProcess(str(model_dir))
    try:
        yield server.url
    finally:
        server.stop()


def run_bench(url: str, api: str, tmp_path) -> dict:
    out = tmp_path / f"bench-{api}.json"
    command = [sys.executable, "-m", "kvtier.entrypoints.cli", "bench", "multi-turn",
               "--url", url, "--api", api, "--num-conversations", "2", "--num-turns", "2",
               "--system-prompt-tokens", "6", "--context-tokens", "2", "--user-tokens", "3",
               "--output-tokens", "4", "--no-progress", "--request-timeout", "60",
               "--run-timeout", "120", "--output-json", str(out),
               "--output-plot", str(tmp_path / f"bench-{api}.png")]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


# ~15 s, nearly all of it the server's start-up; issue 7 wants it in the default suite.
def test_bench_cli_against_kvtier_serve(kvtier_server, tmp_path):
    report = run_bench(kvtier_server, "chat", tmp_path)
    assert tuple(report) == REPORT_FIELDS
    assert (report["num_requests"], report["num_failed"], report["errors"]) == (4, 0, [])
    assert report["output_tokens"] == 4 * 4
    assert report["input_tokens"] > 0
    assert [row["count"] for row in report["ttft_by_turn_s"]] == [2, 2]
    assert "device" in report["hit_rates"]
    assert (tmp_path / "bench-chat.png").stat().st_size > 0
    # The same conversations through the Responses API: later turns send their new messages
    # and the previous_response_id, and the server renders the same prompts from its store.
    responses = run_bench(kvtier_server, "responses", tmp_path)
    assert (responses["num_requests"], responses["num_failed"]) == (4, 0)
    assert (responses["input_tokens"], responses["output_tokens"]) == \
        (report["input_tokens"], report["output_tokens"])
    # And through Anthropic's Messages API: the system prompt beside the turns, the same
    # prompts rendered.
    messages = run_bench(kvtier_server, "messages", tmp_path)
    assert (messages["num_requests"], messages["num_failed"]) == (4, 0)
    assert (messages["input_tokens"], messages["output_tokens"]) == \
        (report["input_tokens"], report["output_tokens"])
