"""`kvtier bench ...`: benchmark tools. `multi-turn` drives any OpenAI-compatible server.

The CLI module imports this lazily and calls `add_arguments(parser)` on its `bench` sub-parser,
then `run(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from kvtier.bench.config import MultiTurnConfig, ServerTarget

DEFAULTS = MultiTurnConfig()
TARGET_DEFAULTS = ServerTarget()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `multi-turn` sub-command (and its options) under `parser`."""
    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    multi_turn = commands.add_parser(
        "multi-turn", help="N concurrent multi-turn conversations against a server",
        description="Shared system prefix, a unique context per conversation, history growing "
                    "each turn; reports TTFT, TPOT, tokens/s and per-tier KV hit rates.")
    _add_workload_arguments(multi_turn)
    _add_target_arguments(multi_turn)
    _add_output_arguments(multi_turn)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-conversations", type=int, default=DEFAULTS.num_conversations)
    group.add_argument("--num-turns", type=int, default=DEFAULTS.num_turns)
    group.add_argument("--system-prompt-tokens", type=int, default=DEFAULTS.system_prompt_tokens,
                       help="length of the prefix every conversation shares")
    group.add_argument("--context-tokens", type=int, default=DEFAULTS.context_tokens,
                       help="length of each conversation's own context")
    group.add_argument("--user-tokens", type=int, default=DEFAULTS.user_tokens,
                       help="length of each new user message")
    group.add_argument("--output-tokens", type=int, default=DEFAULTS.output_tokens)
    group.add_argument("--think-time", type=float, default=DEFAULTS.think_time_s,
                       help="seconds a conversation waits between a reply and its next turn")
    group.add_argument("--seed", type=int, default=DEFAULTS.seed)


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--url", default=TARGET_DEFAULTS.url)
    group.add_argument("--model", default=None, help="default: the first model the server lists")
    group.add_argument("--api", choices=("chat", "completions"), default=TARGET_DEFAULTS.api)
    group.add_argument("--request-timeout", type=float, default=TARGET_DEFAULTS.request_timeout_s)
    group.add_argument("--run-timeout", type=float, default=TARGET_DEFAULTS.run_timeout_s)


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--label", default="", help="name of this run in the report and plot")
    group.add_argument("--output-json", type=Path, default=None)
    group.add_argument("--output-plot", type=Path, default=None, help="PNG path")
    group.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; prints the report's JSON when no --output-json is given.

    Exit status: 0 when every request succeeded, 1 when some failed or the server was unusable.
    """
    from kvtier.bench.client import BenchClientError
    from kvtier.bench.runner import BenchTimeoutError

    try:
        return _run_multi_turn(args)
    except (BenchClientError, BenchTimeoutError) as exc:
        print(f"kvtier bench multi-turn: error: {exc}", file=sys.stderr)
        return 1


def _run_multi_turn(args: argparse.Namespace) -> int:
    from kvtier.bench.plot import write_plot
    from kvtier.bench.report import write_json
    from kvtier.bench.runner import run_multi_turn

    config = MultiTurnConfig(
        num_conversations=args.num_conversations, num_turns=args.num_turns,
        system_prompt_tokens=args.system_prompt_tokens, context_tokens=args.context_tokens,
        user_tokens=args.user_tokens, output_tokens=args.output_tokens,
        think_time_s=args.think_time, seed=args.seed)
    target = ServerTarget(url=args.url, model=args.model, api=args.api,
                          request_timeout_s=args.request_timeout, run_timeout_s=args.run_timeout)
    report = asyncio.run(run_multi_turn(config, target, label=args.label,
                                        show_progress=not args.no_progress))
    if args.output_json is not None:
        write_json(report, args.output_json)
    else:
        print(json.dumps(report, indent=2))
    if args.output_plot is not None:
        write_plot(report, args.output_plot)
    return 1 if report["num_failed"] else 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m kvtier.entrypoints.bench multi-turn ...`)."""
    parser = argparse.ArgumentParser(prog="kvtier bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
