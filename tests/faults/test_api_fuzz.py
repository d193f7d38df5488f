"""API fuzzing from the server's own OpenAPI schema (schemathesis) against a real `kvtier serve`
process: no case may get a 5xx, the server stays healthy after every case, and a fixed greedy
request gives the same tokens before and after the fuzzing (no request changes another's)."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from ..entrypoints.server_process import ServerProcess
from ..tiny_models import make_hf_model

# Cases per operation: enough to reach the edge of every field, small enough for CI (~2 min);
# KVTIER_FUZZ_EXAMPLES=2000 for a longer hunt.
MAX_EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "120"))
CANARY = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fuzz_model"))
    make_hf_model("llama", directory, tokenizer="bytes")
    # A small context keeps generated max_tokens cheap; a queue limit keeps the fuzzer honest.
    process = ServerProcess(directory, "--max-model-len", "256", "--max-num-seqs", "8")
    yield process
    process.stop()


def _canary(url: str) -> list:
    response = httpx.post(f"{url}/v1/completions", json=CANARY, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _fuzz_operation(url: str, schema, method: str, path: str,
                    statuses: dict[int, int]) -> list[str]:
    """Every generated case for one operation, counted into `statuses`; returns a line per
    failure."""
    operation = schema[path][method]
    failures: list[str] = []

    # Valid requests (positive) and requests that break the schema (negative) alike.
    cases = (operation.as_strategy(schemathesis.GenerationMode.POSITIVE)
             | operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run_case(case):
        response = case.call(base_url=url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append(f"{method.upper()} {path} -> {response.status_code}: "
                            f"{response.text[:300]} for body {case.body!r:.300}")
        health = httpx.get(f"{url}/health", timeout=30)
        if health.status_code != 200:
            failures.append(f"/health {health.status_code} after {case.body!r:.300}")

    before = dict(statuses)
    run_case()
    mine = {code: n - before.get(code, 0) for code, n in statuses.items()
            if n > before.get(code, 0)}
    print(f"fuzz {method.upper()} {path}: responses by status {dict(sorted(mine.items()))}")
    return failures


def test_fuzzed_requests_get_no_server_error_and_change_no_other_output(server):
    before = _canary(server.url)
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: list[str] = []
    statuses: dict[int, int] = {}
    for method, path in (("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("post", "/v1/responses"), ("post", "/v1/messages"),
                         ("post", "/v1/messages/count_tokens")):
        failures += _fuzz_operation(server.url, schema, method, path, statuses)
    assert not failures, "\n".join(failures[:20])
    # Cases that reached the engine (most generated completions requests break some rule, so
    # this is counted over all operations): without any, the run proved only the validation.
    assert statuses.get(200), f"no generated case was accepted ({statuses})"
    assert _canary(server.url) == before
