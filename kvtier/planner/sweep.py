"""`--sweep TIER=LOW..HIGH`: the plan again at each size of one tier (powers of two from LOW to
HIGH), and a PNG of hit rate and TTFT against that size, with the ceiling an unbounded cache
reaches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.common.sizes import parse_size
from kvtier.offload.config import OffloadConfig
from kvtier.planner.plan import PlanConfig, run_plan


@dataclass(frozen=True)
class Sweep:
    tier: str
    sizes: tuple[int, ...]


def parse_sweep(text: str) -> Sweep:
    """`host=1GiB..64GiB` -> the tier and its sizes 1, 2, 4, ... 64 GiB."""
    example = "e.g. --sweep host=1GiB..64GiB"
    tier, sep, span = text.partition("=")
    low_text, dots, high_text = span.partition("..")
    if not sep or not dots or not tier:
        raise ValueError(f"--sweep {text!r}: expected TIER=LOW..HIGH, {example}")
    low, high = parse_size(low_text, "--sweep low"), parse_size(high_text, "--sweep high")
    if not 0 < low <= high:
        raise ValueError(f"--sweep {text!r}: need 0 < LOW <= HIGH, {example}")
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= 2
    return Sweep(tier.strip(), tuple(sizes))


def with_tier_size(offload: OffloadConfig | None, tier: str, size: int) -> OffloadConfig:
    """`offload` with tier `tier` (host, or a secondary tier's name) holding `size` bytes."""
    if offload is None:
        raise ValueError("--sweep needs --kv-offload: it varies one of its tiers")
    if tier == "host":
        return dataclasses.replace(offload, cpu_bytes_to_use=size)
    names = [spec.name for spec in offload.secondary_tiers]
    if tier not in names:
        raise ValueError(f"--sweep tier {tier!r} is not in --kv-offload; tiers are "
                         f"{['host', *names]}")
    specs = tuple(
        dataclasses.replace(spec, options=dataclasses.replace(spec.options, max_bytes=size))
        if spec.name == tier else spec for spec in offload.secondary_tiers)
    return dataclasses.replace(offload, secondary_tiers=specs)


def run_sweep(config: PlanConfig, sweep: Sweep) -> dict[str, Any]:
    points = []
    for size in sweep.sizes:
        point = run_plan(dataclasses.replace(
            config, offload=with_tier_size(config.offload, sweep.tier, size)))
        points.append({"bytes": size, "hit_rate": point["hit_rate"],
                       "ttft_s": point.get("ttft_s"),
                       "planner_runtime_s": point["planner_runtime_s"]})
    ceiling = points[0]["hit_rate"]["ceiling"] if points else None
    return {"tier": sweep.tier, "ceiling": ceiling, "points": points}


def write_sweep_plot(sweep: dict[str, Any], label: str, path: Path) -> None:
    """Left: total hit rate against the tier's size, the ceiling dashed. Right: TTFT p50/p90."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    sizes = [point["bytes"] / 2**30 for point in sweep["points"]]
    fig, (hit_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4))
    hit_ax.plot(sizes, [p["hit_rate"]["total"] for p in sweep["points"]], marker="o",
                label="all tiers")
    hit_ax.plot(sizes, [p["hit_rate"][sweep["tier"]] for p in sweep["points"]], marker=".",
                label=sweep["tier"])
    hit_ax.axhline(sweep["ceiling"], linestyle="--", color="gray", label="unbounded cache")
    hit_ax.set_ylabel("hit rate (share of prompt tokens)")
    hit_ax.set_ylim(0, 1)
    hit_ax.legend()
    for key in ("p50", "p90"):
        values = [p["ttft_s"][key] if p["ttft_s"] else None for p in sweep["points"]]
        if all(v is not None for v in values):
            ttft_ax.plot(sizes, values, marker="o", label=key)
    ttft_ax.set_ylabel("predicted TTFT (s)")
    ttft_ax.legend()
    for ax in (hit_ax, ttft_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{sweep['tier']} tier size (GiB)")
    fig.suptitle(label)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
