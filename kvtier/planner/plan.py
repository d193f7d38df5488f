"""One plan: a trace, a model's KV layout, a device pool and offload tiers, simulated, and the
report: per-tier hit rates, prefill saved, predicted TTFT and throughput, the working set."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.entrypoints.bench.trace import ScaledRequest, TraceScaling, load_trace, scale_trace
from kvtier.offload.config import OffloadConfig
from kvtier.planner.blocks import BlockKeys
from kvtier.planner.cost_model import CostModel
from kvtier.planner.model_kv import ModelKV
from kvtier.planner.simulator import SchedulerLimits, SimRequest, Simulation
from kvtier.planner.tiers import check_tier_sizes


@dataclass(frozen=True)
class PlanConfig:
    """What to simulate. `offload` None: the device cache alone; `cost` None: hits only (every
    step takes no time, so the report has no TTFT or throughput); `per_request`: the report
    lists every request's times and hits (`requests`)."""

    trace: Path
    model: ModelKV
    device_bytes: int
    offload: OffloadConfig | None = None
    cost: CostModel | None = None
    scaling: TraceScaling = TraceScaling()
    limits: SchedulerLimits = SchedulerLimits()
    per_request: bool = False

    def __post_init__(self) -> None:
        # Here, not when the simulation builds its pools: after the trace is read, and only once
        # the size that cannot be simulated is one of a sweep's later points.
        self.model.num_device_blocks(self.device_bytes)
        if self.offload is not None:
            check_tier_sizes(self.offload,
                             self.model.bytes_per_block * self.offload.blocks_per_chunk)


def plan_requests(requests: list[ScaledRequest], keys: BlockKeys) -> list[SimRequest]:
    return [SimRequest(r.index, r.arrival_s, r.num_prompt_tokens, r.output_tokens,
                       keys.prompt_keys(r.hash_ids, r.num_prompt_tokens)) for r in requests]


def run_plan(config: PlanConfig, scaled: list[ScaledRequest] | None = None) -> dict[str, Any]:
    """Simulate the trace once and return the report."""
    started = time.perf_counter()
    if scaled is None:
        scaled = scale_trace(load_trace(config.trace), config.scaling)
    keys = BlockKeys(config.scaling.tokens_per_block, config.model.block_size)
    requests = plan_requests(scaled, keys)
    simulation = Simulation(config.model, config.device_bytes, config.offload, config.cost,
                            config.limits)
    simulation.run(requests)
    report = {
        "trace": str(config.trace),
        "scaling": asdict(config.scaling),
        "model": config.model.name,
        "block_size": config.model.block_size,
        "device_kv_bytes": config.device_bytes,
        "num_device_blocks": simulation.manager.kv_cache_config.num_blocks,
        **summarize_plan(simulation, requests),
        "working_set": working_set(requests, config.model, simulation),
        "cost_model": None if config.cost is None else config.cost.to_json(),
        "num_steps": simulation.num_steps,
        "planner_runtime_s": time.perf_counter() - started,
    }
    if config.per_request:
        report["requests"] = [request_row(r, simulation.level_names) for r in requests]
    return report


def request_row(request: SimRequest, level_names: list[str]) -> dict[str, Any]:
    """One request's times (seconds from the trace's start; `ttft_s` from its arrival) and its
    prompt tokens served by each level."""
    first_token = request.first_token_s
    return {"index": request.index, "arrival_s": request.arrival_s,
            "prompt_tokens": request.num_prompt_tokens, "admitted_s": request.admitted_s,
            "first_token_s": first_token, "finished_s": request.finished_s,
            "ttft_s": None if first_token is None else first_token - request.arrival_s,
            "hit_tokens": dict(zip(level_names, request.hit_tokens)),
            "rejected": request.rejected}


def summarize_plan(simulation: Simulation, requests: list[SimRequest]) -> dict[str, Any]:
    served = [r for r in requests if r.rejected is None]
    prompt_tokens = sum(r.num_prompt_tokens for r in served)
    names = simulation.level_names
    per_level = [sum(r.hit_tokens[i] for r in served) for i in range(len(names))]
    saved = sum(per_level)
    hit_rate = {name: _share(tokens, prompt_tokens) for name, tokens in zip(names, per_level)}
    hit_rate["total"] = _share(saved, prompt_tokens)
    hit_rate["ceiling"] = _share(ceiling_hits(served, simulation.block_size), prompt_tokens)
    summary: dict[str, Any] = {
        "num_requests": len(requests),
        "num_rejected": len(requests) - len(served),
        "rejected": sorted({r.rejected for r in requests if r.rejected is not None})[:5],
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(r.output_tokens for r in served),
        "hit_rate": hit_rate,
        "hit_tokens": dict(zip(names, per_level)),
        "prefill_tokens_saved": saved,
        "prefill_tokens_computed": prompt_tokens - saved,
    }
    if simulation.cost is not None:
        summary.update(_timing(served))
    return summary


def _timing(served: list[SimRequest]) -> dict[str, Any]:
    ttfts = [r.first_token_s - r.arrival_s for r in served]
    start = min((r.arrival_s for r in served), default=0.0)
    end = max((r.finished_s for r in served), default=0.0)
    duration = end - start
    output = sum(r.output_tokens for r in served)
    return {
        "ttft_s": _percentiles(ttfts),
        "duration_s": duration,
        "output_tokens_per_s": output / duration if duration > 0 else 0.0,
        "requests_per_s": len(served) / duration if duration > 0 else 0.0,
    }


def _percentiles(values: list[float]) -> dict[str, float | None]:
    stats: dict[str, float | None] = {"mean": float(np.mean(values)) if values else None}
    for p in (50, 90, 99):
        stats[f"p{p}"] = float(np.percentile(values, p)) if values else None
    return stats


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def ceiling_hits(requests: list[SimRequest], block_size: int) -> int:
    """Prompt tokens an unbounded cache would serve: each request's longest prefix of blocks
    seen before, in arrival order, capped as the engine caps a hit."""
    seen: set[Any] = set()
    total = 0
    for request in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        num_hit = 0
        cap = (request.num_prompt_tokens - 1) // block_size
        while num_hit < min(cap, len(request.keys)) and request.keys[num_hit] in seen:
            num_hit += 1
        total += num_hit * block_size
        seen.update(request.keys)
    return total


def working_set(requests: list[SimRequest], model: ModelKV,
                simulation: Simulation) -> dict[str, Any]:
    """Distinct full prompt blocks of the served requests (a rejected one brings none to any
    tier) against what each tier holds."""
    num_distinct = len({key for r in requests if r.rejected is None for key in r.keys})
    distinct_bytes = num_distinct * model.bytes_per_block
    capacities = {"device": simulation.manager.kv_cache_config.num_blocks * model.bytes_per_block}
    if simulation.offload is not None:
        capacities.update({t.name: t.capacity_bytes for t in simulation.offload.all_tiers})
    return {
        "distinct_blocks": num_distinct,
        "bytes_per_block": model.bytes_per_block,
        "bytes_per_token": model.bytes_per_token,
        "bytes": distinct_bytes,
        "tiers": {name: {"capacity_bytes": capacity,
                         "share_of_working_set": (None if capacity is None
                                                  else _share(capacity, distinct_bytes))}
                  for name, capacity in capacities.items()},
    }
