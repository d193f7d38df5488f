"""Options and run of `kvtier bench trace` (the target and output options are bench/cli.py's)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kvtier.entrypoints.bench.config import BenchTarget
from kvtier.entrypoints.bench.trace import TRACE_BLOCK_TOKENS, TraceScaling

DEFAULTS = TraceScaling()


def add_trace_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The trace and its scaling; returns the group (bench/cli.py adds --seed to it)."""
    group = parser.add_argument_group(
        "trace", description="the scaling is printed before the run and kept in the report")
    group.add_argument("--trace", type=Path, required=True,
                       help="JSON-lines trace: timestamp (ms), input_length, output_length, "
                            f"hash_ids (blocks of {TRACE_BLOCK_TOKENS} tokens)")
    group.add_argument("--tokens-per-block", type=int, default=DEFAULTS.tokens_per_block,
                       help=f"tokens that stand for one hash id (default {TRACE_BLOCK_TOKENS}, "
                            "as in the trace; fewer scales every prompt down)")
    group.add_argument("--time-scale", type=float, default=DEFAULTS.time_scale,
                       help="multiply the trace's inter-arrival times (0.5: twice the rate)")
    group.add_argument("--max-requests", type=int, default=None,
                       help="replay only N requests (default: all)")
    group.add_argument("--first-request", type=int, default=0,
                       help="start at the N-th request in arrival order, from 0 (its caches "
                            "start cold: earlier requests are not sent)")
    group.add_argument("--max-output-tokens", type=int, default=None,
                       help="cap each request's output length (default: the trace's)")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="at most N requests in flight; later arrivals wait for a slot, in "
                            "order (default: unbounded, as the trace arrives)")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="token ids are drawn from [0, N) (default: the in-process model's "
                            "vocabulary; required with a server, which does not say it)")
    return group


def run_trace_command(args: argparse.Namespace, target: BenchTarget) -> int:
    """Replay, then write the report (JSON to stdout without --output-json) and the plot."""
    from kvtier.entrypoints.bench.report import emit_report
    from kvtier.entrypoints.bench.trace_runner import TraceReplayConfig, run_trace

    scaling = TraceScaling(tokens_per_block=args.tokens_per_block, time_scale=args.time_scale,
                           max_requests=args.max_requests,
                           max_output_tokens=args.max_output_tokens, vocab_size=args.vocab_size,
                           seed=args.seed, first_request=args.first_request)
    config = TraceReplayConfig(args.trace, scaling, args.max_concurrency)
    print(scaling.describe(), file=sys.stderr)
    report = asyncio.run(run_trace(config, target, label=args.label,
                                   show_progress=not args.no_progress))
    return emit_report(report, args.output_json, args.output_plot, _write_trace_plot)


def _write_trace_plot(report: dict, path: Path) -> None:
    # matplotlib only when a plot is asked for.
    from kvtier.entrypoints.bench.trace_plot import write_trace_plot
    write_trace_plot(report, path)
