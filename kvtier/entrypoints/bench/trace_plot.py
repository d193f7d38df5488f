"""PNG plot of one trace replay: TTFT of each request over the replay, and the TPOT summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run on machines without a display

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before this import)


def write_trace_plot(report: dict[str, Any], path: Path) -> None:
    """Left: TTFT against arrival time, one point per request. Right: TPOT mean and
    percentiles, in milliseconds."""
    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [row for row in report["requests"] if row["ttft_s"] is not None]
    ttft_ax.scatter([row["arrival_s"] for row in rows], [row["ttft_s"] * 1000 for row in rows],
                    s=8)
    ttft_ax.set_xlabel("arrival (s from the replay's start)")
    ttft_ax.set_ylabel("TTFT (ms)")
    ttft_ax.set_title("Time to first token per request")
    tpot = report["tpot_s"]
    keys = [key for key in ("mean", "p50", "p90", "p99") if tpot[key] is not None]
    tpot_ax.bar(keys, [tpot[key] * 1000 for key in keys])
    tpot_ax.set_ylabel("TPOT (ms)")
    tpot_ax.set_title("Time per output token")
    scaling = report["scaling"]
    fig.suptitle(f"{report['label']}: {report['num_requests']} trace requests, "
                 f"{scaling['tokens_per_block']} tokens/block, time x{scaling['time_scale']:g}, "
                 f"{report['output_tokens_per_s']:.1f} output tok/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
