"""The router's policies compared on a multi-turn workload over three instances.

For each policy (kv-aware, round-robin, least-loaded) three fresh `kvtier serve` instances of
the default model start (so no policy inherits another's caches), each with device KV too small
to hold every conversation (`--device-kv-bytes`, by default ~7 of the 24 conversations), then a
`kvtier router --policy P` in front of them, and `kvtier bench multi-turn`'s workload runs
through the router. Reported per policy: the cache hit rate (share of prompt tokens the
instances served from cache, from their usage through the router's metrics), TTFT p50/p90,
output tokens/s, the routing decisions by reason, and each instance's requests in flight and
queued prefill tokens as the router saw them every 0.5 s; one JSON and one PNG. Each instance
gets `--threads-per-instance` torch threads (default: the cores shared out, at least one), so
the instances do not spin against each other at OpenMP barriers.

    python benchmarks/router_bench.py                                   # the full comparison
    python benchmarks/router_bench.py --conversations 4 --num-turns 2 --policies kv-aware

Run it from the repository root with kvtier installed (or PYTHONPATH=.), on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the server launcher

from server_process import ServerProcess, free_port, threads_env  # noqa: E402

from kvtier.entrypoints.bench import MultiTurnConfig, ServerTarget, run_multi_turn  # noqa: E402
from kvtier.entrypoints.bench.metrics_scrape import parse_samples  # noqa: E402

POLICIES = ("kv-aware", "round-robin", "least-loaded")
NUM_INSTANCES = 3
DEFAULT_JSON = Path("benchmarks/results/router_bench.json")
DEFAULT_PLOT = Path("docs/router_bench.png")
# Seconds between samples of each instance's in-flight requests and queued prefill tokens.
QUEUE_SAMPLE_S = 0.5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--num-turns", type=int, default=5)
    parser.add_argument("--system-prompt-tokens", type=int, default=128)
    parser.add_argument("--context-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--start-interval", type=float, default=0.5,
                        help="seconds between conversations' first turns")
    parser.add_argument("--device-kv-bytes", default="128MiB",
                        help="device KV per instance (SmolLM2 bf16: ~23 KB a token)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads-per-instance", type=int,
                        default=max(1, (os.cpu_count() or 1) // NUM_INSTANCES),
                        help="torch threads of each instance (default: the cores shared out, at "
                             "least 1; more instances' threads than cores spin against each "
                             "other at OpenMP barriers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--output-json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--output-plot", type=Path, default=DEFAULT_PLOT)
    parser.add_argument("--log-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "router_bench")
    return parser.parse_args()


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}",
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    return [sys.executable, "-m", "kvtier.entrypoints.cli", "serve", "--port", str(port),
            "--dtype", "bfloat16", "--kv-cache-memory-bytes", args.device_kv_bytes,
            "--max-model-len", str(args.max_model_len), "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events), "--uvicorn-log-level", "warning"]


def router_command(policy: str, port: int, instances: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvtier.entrypoints.cli", "router", "--policy", policy,
            "--port", str(port), "--uvicorn-log-level", "warning",
            *[arg for url in instances for arg in ("--instance", url)]]


def router_counters(url: str) -> dict[str, float]:
    """The router's token counters, and its decisions as "decisions:<reason>"."""
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=10.0).text)
    counters: dict[str, float] = {}
    for (name, labels), value in samples.items():
        name = name.removeprefix("kvtier_router:")
        if name == "decisions":
            name = f"decisions:{dict(labels)['reason']}"
        elif name not in ("prompt_tokens", "actual_cached_tokens", "predicted_cached_tokens"):
            continue
        counters[name] = counters.get(name, 0.0) + value
    return counters


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    workload = MultiTurnConfig(
        num_conversations=args.conversations, num_turns=args.num_turns,
        system_prompt_tokens=args.system_prompt_tokens, context_tokens=args.context_tokens,
        user_tokens=args.user_tokens, output_tokens=args.output_tokens,
        start_interval_s=args.start_interval, seed=args.seed)
    name = policy.replace("-", "_")
    env = threads_env(args.threads_per_instance)
    with ExitStack() as stack:
        instances = []
        for i in range(NUM_INSTANCES):
            port = free_port()
            instances.append(stack.enter_context(ServerProcess(
                serve_command(args, port), env, port,
                args.log_dir / f"{name}-instance{i}.log", args.startup_timeout)))
        port = free_port()
        router = stack.enter_context(ServerProcess(
            router_command(policy, port, [i.url for i in instances]), dict(os.environ), port,
            args.log_dir / f"{name}-router.log", args.startup_timeout))
        target = ServerTarget(url=router.url)
        report, queues = asyncio.run(run_sampling_queues(workload, target, policy))
        counters = router_counters(router.url)
    prompt = counters.get("prompt_tokens", 0.0)
    cached = counters.get("actual_cached_tokens", 0.0)
    predicted = counters.get("predicted_cached_tokens", 0.0)
    return {"policy": policy, "threads_per_instance": args.threads_per_instance,
            "hit_rate": cached / prompt if prompt else None,
            "predicted_cached_tokens": predicted, "cached_tokens": cached,
            "prompt_tokens": prompt, "ttft_p50_s": report["ttft_s"]["p50"],
            "ttft_p90_s": report["ttft_s"]["p90"],
            "output_tokens_per_s": report["output_tokens_per_s"],
            "num_failed": report["num_failed"],
            "decisions": {k.removeprefix("decisions:"): v for k, v in counters.items()
                          if k.startswith("decisions:")},
            "queues": queues, "report": report}


async def run_sampling_queues(workload: MultiTurnConfig, target: ServerTarget,
                              policy: str) -> tuple[dict, list[dict]]:
    """The workload's report, and each instance's load as the router saw it every
    QUEUE_SAMPLE_S: [{"t": s, "in_flight": [...], "queued_tokens": [...]}, ...]."""
    samples: list[dict] = []
    started = time.perf_counter()

    async def sample() -> None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            while True:
                state = (await client.get(f"{target.url}/router/instances")).json()
                instances = state["instances"]
                samples.append({"t": round(time.perf_counter() - started, 2),
                                "in_flight": [i["in_flight"] for i in instances],
                                "queued_tokens": [i["queued_tokens"] for i in instances]})
                await asyncio.sleep(QUEUE_SAMPLE_S)

    sampler = asyncio.create_task(sample())
    try:
        report = await run_multi_turn(workload, target, label=policy)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await sampler
    return report, samples


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in results]
    panels = [("hit rate", [r["hit_rate"] or 0.0 for r in results]),
              ("TTFT p50 (s)", [r["ttft_p50_s"] or 0.0 for r in results]),
              ("TTFT p90 (s)", [r["ttft_p90_s"] or 0.0 for r in results]),
              ("output tokens/s", [r["output_tokens_per_s"] for r in results])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(names, values, color=["tab:green", "tab:blue", "tab:orange"][:len(names)])
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"router policies, {NUM_INSTANCES} instances")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if args.threads_per_instance < 1:
        raise SystemExit("router_bench: --threads-per-instance must be at least 1")
    if unknown:
        raise SystemExit(f"router_bench: unknown policies {unknown}; use {', '.join(POLICIES)}")
    results = [run_policy(args, policy) for policy in policies]
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.output_plot)
    for r in results:
        hit = "n/a" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        print(f"{r['policy']:13s} hit rate {hit}  TTFT p50 {r['ttft_p50_s']}  "
              f"p90 {r['ttft_p90_s']}  out tok/s {r['output_tokens_per_s']:.1f}  "
              f"failed {r['num_failed']}  decisions {r['decisions']}")
        by_turn = [t["p90"] and round(t["p90"], 2) for t in r["report"]["ttft_by_turn_s"]]
        peaks = [max(column) for column in zip(*(q["in_flight"] for q in r["queues"]))]
        print(f"{'':13s} TTFT p90 by turn {by_turn}  peak in flight per instance {peaks}")


if __name__ == "__main__":
    main()
