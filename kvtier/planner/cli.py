"""`kvtier plan`: size the KV cache tiers for a request trace, by simulation (no model runs).

`kvtier plan --trace T --device-kv SIZE [--kv-offload host=...,disk=...]` simulates the trace on
the engine's own KV cache code; `kvtier plan calibrate` measures this machine for the cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from kvtier.common.output_paths import check_output_path
from kvtier.common.plotting import require_matplotlib
from kvtier.common.sizes import parse_size
from kvtier.common.urls import check_http_url
from kvtier.config import KV_CACHE_DTYPES
from kvtier.entrypoints.bench.trace import TRACE_BLOCK_TOKENS, TraceScaling
from kvtier.offload.config import OffloadConfig, parse_kv_offload
from kvtier.planner.cost_model import (
    CostModel,
    default_cost_model_path,
    load_cost_model,
    write_cost_model,
)
from kvtier.planner.model_kv import model_kv
from kvtier.planner.plan import PlanConfig, run_plan
from kvtier.planner.simulator import SchedulerLimits
from kvtier.planner.sweep import Sweep, parse_sweep, run_sweep, with_tier_size, write_sweep_plot

LIMITS = SchedulerLimits()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Without this, `calibrate --output` would be taken for an abbreviation of the plan's own
    # --output-json / --output-plot before the sub-command gets it.
    parser.allow_abbrev = False
    commands = parser.add_subparsers(dest="plan_command", metavar="[calibrate]")
    calibrate = commands.add_parser(
        "calibrate", help="measure this machine with a model; write a cost model JSON",
        description="Batches of prompts through the engine with every step timed (prefills "
                    "alone, many prompts prefilled together, 128 sequences decoding, long "
                    "contexts decoding, steps that mix them), host memory copies and disk "
                    "reads, fitted to the planner's cost model.")
    _add_model_arguments(calibrate)
    calibrate.add_argument("--device", default=None, help="torch device (default: the engine's)")
    calibrate.add_argument("--disk-dir", default=None,
                           help="directory whose disk the disk tier would use (default: the "
                                "temporary directory)")
    calibrate.add_argument("--block-size", type=int, default=16,
                           help="engine block size (tokens) to measure with, the one you serve "
                                "with: step costs depend on it (default 16)")
    calibrate.add_argument("--kv-offload", default=None,
                           help="the tiers you serve with (the engine's flag, directories "
                                "included): the engine is measured storing every chunk it "
                                "computes to them, with prefix caching on")
    calibrate.add_argument("--served-url", default=None,
                           help="a running `kvtier serve` of the same model and flags, e.g. "
                                "http://127.0.0.1:8000: the batches are served too, and what "
                                "serving adds is fitted (server_s_per_step, "
                                "server_s_per_token)")
    calibrate.add_argument("--output", type=Path, required=True, help="cost model JSON path")
    _add_plan_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model directory (config.json alone is enough to plan), its "
                             "config.json, or a .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"),
                        default="auto", help="model dtype (auto: bfloat16, as the engine)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        default="auto", help="how K and V are stored, as the engine's flag "
                                             "(auto: the dtype; fp8: one byte an element)")


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    group = parser.add_argument_group("plan")
    group.add_argument("--trace", type=Path, help="JSON-lines trace (the bench trace format)")
    group.add_argument("--device-kv", help="device KV cache size, e.g. 4GiB")
    group.add_argument("--kv-offload", default=None,
                       help="offload tiers as for kvtier serve, e.g. host=16GiB,"
                            "disk=/var/cache/kvtier:200GiB; only sizes matter here, so "
                            "host=16GiB,disk=200GiB is the same plan")
    group.add_argument("--cost-model", type=Path, default=None,
                       help="cost model JSON from `kvtier plan calibrate` (default: the one "
                            "shipped for SmolLM2-135M on a 2-core VM, with the default model)")
    group.add_argument("--hits-only", action="store_true",
                       help="no cost model: hit rates only, no TTFT or throughput")
    group.add_argument("--block-size", type=int, default=16, help="engine block size (tokens)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output served (default: the model's context)")
    group.add_argument("--max-num-batched-tokens", type=int,
                       default=LIMITS.max_num_batched_tokens)
    group.add_argument("--max-num-seqs", type=int, default=LIMITS.max_num_seqs)
    group.add_argument("--tokens-per-block", type=int, default=TRACE_BLOCK_TOKENS,
                       help=f"tokens per hash id (default {TRACE_BLOCK_TOKENS}, as the trace)")
    group.add_argument("--time-scale", type=float, default=1.0,
                       help="multiply the trace's inter-arrival times")
    group.add_argument("--max-requests", type=int, default=None)
    group.add_argument("--first-request", type=int, default=0,
                       help="start at the N-th request in arrival order, from 0")
    group.add_argument("--max-output-tokens", type=int, default=None)
    group.add_argument("--sweep", default=None,
                       help="TIER=LOW..HIGH: plan again at each power-of-two size of one tier "
                            "(host or a secondary tier's name), e.g. host=1GiB..64GiB")
    group.add_argument("--output-json", type=Path, default=None)
    group.add_argument("--output-plot", type=Path, default=None,
                       help="PNG of the sweep: hit rate and TTFT against the tier's size")


def run(args: argparse.Namespace) -> int:
    if args.plan_command == "calibrate":
        return _run_calibrate(args)
    config = _plan_config(args)
    sweep = None if args.sweep is None else parse_sweep(args.sweep)
    if sweep is not None:
        _check_sweep(config, sweep)
    if args.output_plot is not None:
        if sweep is None:
            raise ValueError("--output-plot draws the sweep; add --sweep TIER=LOW..HIGH")
        require_matplotlib()
    check_output_path(args.output_json, "--output-json")
    check_output_path(args.output_plot, "--output-plot")
    print(config.scaling.describe(), file=sys.stderr)
    report = run_plan(config)
    if sweep is not None:
        report["sweep"] = run_sweep(config, sweep)
        if args.output_plot is not None:
            write_sweep_plot(report["sweep"], f"{config.model.name}: {config.trace.name}",
                             args.output_plot)
    text = json.dumps(report, indent=2)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(text + "\n")
    else:
        print(text)
    return 0


def _check_sweep(config: PlanConfig, sweep: Sweep) -> None:
    """Its tier exists, and its smallest and largest sizes can be simulated (checked now, not
    after the plans before them)."""
    for size in (sweep.sizes[0], sweep.sizes[-1]):
        offload = with_tier_size(config.offload, sweep.tier, size)
        try:
            dataclasses.replace(config, offload=offload)
        except ValueError as error:
            raise ValueError(f"--sweep {sweep.tier} at {size} bytes: {error}") from None


def _plan_config(args: argparse.Namespace) -> PlanConfig:
    if args.trace is None or args.device_kv is None:
        raise ValueError("--trace and --device-kv are required (or run `kvtier plan calibrate`)")
    for flag, value in (("--block-size", args.block_size),
                        ("--tokens-per-block", args.tokens_per_block),
                        ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not math.isfinite(args.time_scale) or args.time_scale < 0:
        raise ValueError(f"--time-scale must be a finite number >= 0, got {args.time_scale}")
    offload = (None if args.kv_offload is None else OffloadConfig.from_extra_config(
        parse_kv_offload(_with_directories(args.kv_offload))))
    model = model_kv(args.model, args.block_size,
                     "bfloat16" if args.dtype == "auto" else args.dtype, args.max_model_len,
                     args.kv_cache_dtype)
    scaling = TraceScaling(tokens_per_block=args.tokens_per_block, time_scale=args.time_scale,
                           max_requests=args.max_requests,
                           max_output_tokens=args.max_output_tokens,
                           first_request=args.first_request)
    limits = SchedulerLimits(args.max_num_batched_tokens, args.max_num_seqs)
    return PlanConfig(args.trace, model, parse_size(args.device_kv, "--device-kv"), offload,
                      _cost_model(args), scaling, limits)


def _with_directories(flag: str) -> str:
    """`disk=200GiB` -> `disk=unused:200GiB`: a plan needs a tier's size, not its directory,
    so the flag may leave it out (the engine's form with a directory works too)."""
    parts = []
    for part in flag.split(","):
        key, sep, value = part.strip().partition("=")
        if key in ("disk", "fs") and sep and ":" not in value and value[:1].isdigit():
            part = f"{key}=unused:{value}"
        parts.append(part)
    return ",".join(parts)


def _cost_model(args: argparse.Namespace) -> CostModel | None:
    if args.hits_only:
        if args.cost_model is not None:
            raise ValueError("--hits-only plans without a cost model; leave out --cost-model")
        return None
    if args.cost_model is not None:
        return load_cost_model(args.cost_model)
    if args.model is not None:
        raise ValueError("the shipped cost model is SmolLM2-135M's; for --model give "
                         "--cost-model FILE (`kvtier plan calibrate --model ... --output FILE` "
                         "measures one) or --hits-only")
    return load_cost_model(default_cost_model_path())


def _run_calibrate(args: argparse.Namespace) -> int:
    # Imported here: it loads the engine (torch), which planning never needs.
    from kvtier.planner.calibrate import calibrate

    # Checked before the minutes of measuring whose result they would lose.
    check_output_path(args.output, "--output")
    _check_disk_dir(args.disk_dir)
    if args.served_url is not None:
        check_http_url(args.served_url, "--served-url")
    result = calibrate(args.model, args.dtype, args.device, args.disk_dir,
                       block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                       kv_offload=args.kv_offload,
                       served_url=args.served_url)
    write_cost_model(result.cost, args.output, result.measurements, result.served_measurements)
    print(json.dumps(result.cost.to_json(), indent=2))
    return 0


def _check_disk_dir(path: str | None) -> None:
    """--disk-dir is a directory this user can write a file in (made if missing): tried with a
    file, since permission bits say nothing of a read-only mount or of root."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--disk-dir {path} is not a directory; give the directory whose "
                         "disk the disk tier would use")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix="kvtier-calibrate-"):
            pass
    except OSError as error:
        raise ValueError(f"--disk-dir {path}: cannot write a file there ({error.strerror}); "
                         "give a directory where this user may write") from None
