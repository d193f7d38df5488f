"""PNG plot of one multi-turn run: TTFT percentiles per turn and the TPOT summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run on machines without a display

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before this import)


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Left: TTFT p50/p90/p99 by turn. Right: TPOT mean and percentiles, in milliseconds."""
    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [row for row in report["ttft_by_turn_s"] if row["count"] > 0]
    turns = [row["turn"] for row in rows]
    for key in ("p50", "p90", "p99"):
        ttft_ax.plot(turns, [row[key] * 1000 for row in rows], marker="o", label=key)
    ttft_ax.set_xticks(turns)
    ttft_ax.set_xlabel("turn (0 = first)")
    ttft_ax.set_ylabel("TTFT (ms)")
    ttft_ax.set_title("Time to first token by turn")
    ttft_ax.legend()
    tpot = report["tpot_s"]
    keys = [key for key in ("mean", "p50", "p90", "p99") if tpot[key] is not None]
    tpot_ax.bar(keys, [tpot[key] * 1000 for key in keys])
    tpot_ax.set_ylabel("TPOT (ms)")
    tpot_ax.set_title("Time per output token")
    fig.suptitle(f"{report['label']}: {report['workload']['num_conversations']} conversations, "
                 f"{report['output_tokens_per_s']:.1f} output tok/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
