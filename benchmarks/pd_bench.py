"""1P1D against two colocated instances: steady decodes while long prompts arrive in bursts.

Two setups of `kvtier serve` (the default model unless --model), each behind a `kvtier router`:

* 1P1D: a prefill instance (P2PConnector kv_producer) and a decode instance (kv_consumer)
  behind `kvtier router --prefill --decode`: prompts are computed on one, decoded on the other;
* 1p1d-local: the same, with `--local-prefill-tokens` (default 512): prompts that short (the
  streams') are computed on the decode instance, only the long ones on the prefill instance;
* colocated: two plain instances behind `kvtier router --instance A --instance B --policy
  round-robin`: each computes its prompts between its decode steps.

Both get the same client workload: `--streams` ongoing decodes (each sends a fresh prompt of
`--stream-prompt-tokens` tokens for `--stream-output-tokens` tokens, then the next, until the
last burst is answered), and `--bursts` bursts of `--burst-size` long prompts (`--long-min-tokens`
to `--long-max-tokens` tokens, `--long-output-tokens` tokens out), one every `--burst-interval`
seconds. Reported per setup and class (stream, long): TTFT and TPOT p50/p90, and the throughput;
a markdown table on standard output and the whole report with --out-json. Disaggregation's
point is the stream class's TPOT: its decode steps never wait for a long prompt's prefill.

Both setups run on the same CPUs: every instance gets `--threads-per-instance` torch threads
(default half the cores, so two instances fill them), whichever its role. `--scale` multiplies
every token count and the burst interval, e.g. a quick check:

    PYTHONPATH=. python benchmarks/pd_bench.py --scale 0.05 --bursts 1 --out-json /tmp/pd.json

Run it from the repository root with kvtier installed (or PYTHONPATH=.), on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the server launcher

from server_process import (  # noqa: E402
    ServerProcess,
    ServerStartError,
    free_port,
    threads_env,
)

from kvtier.entrypoints.bench.client import (  # noqa: E402
    OpenAIStreamClient,
    RequestResult,
    open_server_session,
    request_body,
)
from kvtier.entrypoints.bench.config import ServerTarget  # noqa: E402
from kvtier.entrypoints.bench.metrics_scrape import parse_samples  # noqa: E402
from kvtier.entrypoints.bench.report import request_summary  # noqa: E402
from kvtier.entrypoints.bench.workload import ConversationId, make_text  # noqa: E402

SETUPS = ("1p1d", "1p1d-local", "colocated")
CLASSES = ("stream", "long")
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class Workload:
    num_streams: int
    stream_prompt_tokens: int
    stream_output_tokens: int
    long_min_tokens: int
    long_max_tokens: int
    long_output_tokens: int
    num_bursts: int
    burst_size: int
    burst_interval_s: float
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        def tokens(n: int) -> int:
            # At least 2: a request's TPOT needs a second token.
            return max(2, round(n * args.scale))
        return cls(args.streams, tokens(args.stream_prompt_tokens),
                   tokens(args.stream_output_tokens), tokens(args.long_min_tokens),
                   max(tokens(args.long_min_tokens), tokens(args.long_max_tokens)),
                   args.long_output_tokens, args.bursts, args.burst_size,
                   args.burst_interval * args.scale, args.seed)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--model", help="model of every instance (default: kvtier's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory-bytes", default="1GiB",
                        help="device KV per instance (SmolLM2 bf16: ~23 KB a token)")
    parser.add_argument("--threads-per-instance", type=int,
                        default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt-tokens", type=int, default=256)
    parser.add_argument("--stream-output-tokens", type=int, default=128)
    parser.add_argument("--long-min-tokens", type=int, default=2048)
    parser.add_argument("--long-max-tokens", type=int, default=4096)
    parser.add_argument("--long-output-tokens", type=int, default=4)
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--burst-size", type=int, default=4)
    parser.add_argument("--burst-interval", type=float, default=30.0,
                        help="seconds from the start to the first burst and between bursts")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies every token count but the long prompts' output, and "
                             "the burst interval")
    parser.add_argument("--local-prefill-tokens", type=int, default=512,
                        help="the 1p1d-local router's --local-prefill-tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--run-timeout", type=float, default=3600.0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out-json", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "pd_bench")
    args = parser.parse_args()
    unknown = sorted(set(args.setups.split(",")) - set(SETUPS))
    if unknown:
        parser.error(f"unknown setups {unknown}; use {', '.join(SETUPS)}")
    if min(args.streams, args.bursts, args.burst_size, args.threads_per_instance) < 1 \
            or args.long_output_tokens < 1 or args.scale <= 0:
        parser.error("--streams, --bursts, --burst-size, --threads-per-instance and "
                     "--long-output-tokens must be >= 1, --scale > 0")
    return args


# ---- the processes -------------------------------------------------------------------------

def serve_command(args: argparse.Namespace, port: int, role: str | None,
                  events: bool) -> list[str]:
    """`kvtier serve` of one instance; `role` None: no connector (a colocated instance);
    `events`: it publishes its KV events (the router counts a prompt's uncached tokens with
    them)."""
    command = [sys.executable, "-m", "kvtier.entrypoints.cli", "serve", "--port", str(port),
               "--dtype", args.dtype, "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
               "--uvicorn-log-level", "warning"]
    if events:
        command += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})]
    if args.model is not None:
        command.append(args.model)
    if role is not None:
        command += ["--kv-transfer-config", json.dumps({
            "kv_connector": "P2PConnector", "kv_role": role,
            "kv_load_timeout_s": args.request_timeout,
            "kv_connector_extra_config": {"send_timeout_s": args.request_timeout}})]
    return command


def router_command(args: argparse.Namespace, port: int, setup: str,
                   urls: list[str]) -> list[str]:
    command = [sys.executable, "-m", "kvtier.entrypoints.cli", "router", "--port", str(port),
               "--uvicorn-log-level", "warning"]
    if setup.startswith("1p1d"):
        # A burst queues on the one prefill instance: its prompts must not fall back to the
        # decode instance for being late.
        command += ["--prefill", urls[0], "--decode", urls[1],
                    "--prefill-timeout", str(args.request_timeout)]
        if setup == "1p1d-local":
            command += ["--local-prefill-tokens", str(args.local_prefill_tokens)]
        return command
    return command + ["--policy", "round-robin", "--instance", urls[0], "--instance", urls[1]]


def wait_router_ready(url: str, setup: str, deadline_s: float) -> None:
    """Until the router sees both instances healthy (and, for 1P1D, the decode instance's
    transport address: before it the router sends no prefill)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            instances = httpx.get(f"{url}/router/instances", timeout=5.0).json()["instances"]
            if all(i["healthy"] for i in instances) and (
                    not setup.startswith("1p1d") or any(i["transport_address"] for i in instances)):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise ServerStartError(f"router {url} did not see its instances within {deadline_s} s")


def start_setup(args: argparse.Namespace, setup: str, stack: ExitStack) -> str:
    """Start the setup's two instances and its router; the router's URL."""
    env = threads_env(args.threads_per_instance)
    roles = ("kv_producer", "kv_consumer") if setup.startswith("1p1d") \
        else (None, None)
    urls = []
    for i, role in enumerate(roles):
        port = free_port()
        server = stack.enter_context(ServerProcess(
            serve_command(args, port, role, events=setup == "1p1d-local"), env, port,
            args.log_dir / f"{setup}-instance{i}.log", args.startup_timeout))
        urls.append(server.url)
    port = free_port()
    router = stack.enter_context(ServerProcess(
        router_command(args, port, setup, urls), dict(os.environ), port,
        args.log_dir / f"{setup}-router.log", args.startup_timeout))
    wait_router_ready(router.url, setup, args.startup_timeout)
    return router.url


# ---- the workload --------------------------------------------------------------------------

def _prompt(workload: Workload, part: str, num_tokens: int) -> str:
    # A string seed gives every request its own text, the same in every run and setup.
    return make_text(random.Random(f"pd-bench:{workload.seed}:{part}"), num_tokens)


async def _send(client: OpenAIStreamClient, model: str, cid: int, turn: int, text: str,
                output_tokens: int) -> RequestResult:
    path, body = request_body("completions", model, [{"role": "user", "content": text}],
                              output_tokens)
    return await client.send_body(ConversationId(cid), turn, path, body)


async def _stream(client: OpenAIStreamClient, model: str, workload: Workload, index: int,
                  bursts_done: asyncio.Event) -> list[RequestResult]:
    """One ongoing decode: a request after the other until the bursts are over."""
    results: list[RequestResult] = []
    while not bursts_done.is_set():
        text = _prompt(workload, f"stream:{index}:{len(results)}", workload.stream_prompt_tokens)
        results.append(await _send(client, model, index, len(results), text,
                                   workload.stream_output_tokens))
    return results


async def _bursts(client: OpenAIStreamClient, model: str, workload: Workload,
                  started: float) -> list[RequestResult]:
    rng = random.Random(f"pd-bench:{workload.seed}:long-lengths")
    results: list[RequestResult] = []
    for burst in range(workload.num_bursts):
        due = started + (burst + 1) * workload.burst_interval_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        sends = [_send(client, model, burst, i, _prompt(
                     workload, f"long:{burst}:{i}",
                     rng.randint(workload.long_min_tokens, workload.long_max_tokens)),
                     workload.long_output_tokens)
                 for i in range(workload.burst_size)]
        results += await asyncio.gather(*sends)
    return results


async def warm_up(url: str, workload: Workload, request_timeout_s: float) -> None:
    """A short request on each instance (round-robin: one each; 1P1D: both each time), so
    that no first-request cost lands in the measured run."""
    target = ServerTarget(url=url, api="completions", request_timeout_s=request_timeout_s)
    async with open_server_session(target, 1) as session:
        client = session.client(2, time.perf_counter())
        for i in range(2):
            result = await _send(client, session.model, i, 0, _prompt(workload, f"warm:{i}", 16),
                                 2)
            if result.error is not None:
                raise RuntimeError(f"pd_bench: warm-up request failed: {result.error}")


async def run_workload(url: str, workload: Workload, request_timeout_s: float,
                       run_timeout_s: float) -> dict[str, list[RequestResult] | float]:
    """The requests of each class, and the run's duration in seconds."""
    target = ServerTarget(url=url, api="completions", request_timeout_s=request_timeout_s)
    async with open_server_session(target, workload.num_streams + workload.burst_size) as session:
        started = time.perf_counter()
        client = session.client(workload.stream_output_tokens, started)
        bursts_done = asyncio.Event()
        async with asyncio.timeout(run_timeout_s):
            streams = [asyncio.create_task(_stream(client, session.model, workload, i,
                                                   bursts_done))
                       for i in range(workload.num_streams)]
            try:
                long = await _bursts(client, session.model, workload, started)
            finally:
                bursts_done.set()
            stream = [r for results in await asyncio.gather(*streams) for r in results]
        return {"stream": stream, "long": long, "duration_s": time.perf_counter() - started}


# ---- the report ----------------------------------------------------------------------------

def prefill_outcomes(router_url: str) -> dict[str, float]:
    """The router's prefills by outcome (1P1D: anything but ok means the decode instance
    computed that prompt)."""
    samples = parse_samples(httpx.get(f"{router_url}/metrics", timeout=10.0).text)
    return {dict(labels)["outcome"]: value for (name, labels), value in samples.items()
            if name == "kvtier_router:prefills"}


def run_setup(args: argparse.Namespace, setup: str, workload: Workload) -> dict:
    with ExitStack() as stack:
        url = start_setup(args, setup, stack)
        asyncio.run(warm_up(url, workload, args.request_timeout))
        before = prefill_outcomes(url)
        run = asyncio.run(run_workload(url, workload, args.request_timeout, args.run_timeout))
        prefills = {outcome: value - before.get(outcome, 0.0)
                    for outcome, value in prefill_outcomes(url).items()}
    duration = run.pop("duration_s")
    return {"setup": setup, "duration_s": duration, "prefills": prefills,
            "all": request_summary([r for c in CLASSES for r in run[c]], duration, {}),
            **{c: request_summary(run[c], duration, {}) for c in CLASSES}}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def markdown(results: list[dict]) -> str:
    lines = ["| setup | class | requests | failed | TTFT p50 (ms) | TTFT p90 (ms) "
             "| TPOT p50 (ms) | TPOT p90 (ms) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for c in CLASSES:
            s = r[c]
            lines.append(f"| {r['setup']} | {c} | {s['num_requests']} | {s['num_failed']} "
                         f"| {_ms(s['ttft_s']['p50'])} | {_ms(s['ttft_s']['p90'])} "
                         f"| {_ms(s['tpot_s']['p50'])} | {_ms(s['tpot_s']['p90'])} |")
    lines += ["", "| setup | duration (s) | output tok/s | prompt tok/s | requests/s | prefills |",
              "|---|---|---|---|---|---|"]
    for r in results:
        s = r["all"]
        prefills = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["prefills"].items())) or "-"
        lines.append(f"| {r['setup']} | {r['duration_s']:.1f} | {s['output_tokens_per_s']:.1f} "
                     f"| {s['input_tokens_per_s']:.1f} | {s['requests_per_s']:.2f} "
                     f"| {prefills} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    workload = Workload.from_args(args)
    results = [run_setup(args, setup, workload) for setup in args.setups.split(",")]
    print(markdown(results))
    if args.out_json is not None:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps({
            "workload": asdict(workload), "threads_per_instance": args.threads_per_instance,
            "model": args.model, "dtype": args.dtype, "results": results}, indent=2) + "\n")
    errors = sorted({e for r in results for e in r["all"]["errors"]})
    for error in errors:
        print(f"pd_bench: failed request: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
