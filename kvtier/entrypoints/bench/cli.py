"""`kvtier bench ...`: benchmark tools. `multi-turn` (conversations) and `trace` (a request trace
replayed on its clock) drive any OpenAI-compatible server, or a kvtier engine built in this
process (`--engine in-process`, no HTTP).

The CLI module imports this lazily and calls `add_arguments(parser)` on its `bench` sub-parser,
then `run(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from kvtier.common.output_paths import check_output_path
from kvtier.common.plotting import require_matplotlib
from kvtier.engine.args import add_engine_args, engine_config_from_args
from kvtier.entrypoints.bench.config import BenchTarget, EngineTarget, MultiTurnConfig, ServerTarget
from kvtier.entrypoints.bench.trace_cli import add_trace_arguments, run_trace_command

DEFAULTS = MultiTurnConfig()
TARGET_DEFAULTS = ServerTarget()
ENGINES = ("server", "in-process")
# Engine options the bench defines itself, with a meaning for both targets (see their help).
_SHARED_OPTIONS = ("model", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `multi-turn` and `trace` sub-commands (and their options) under `parser`."""
    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    multi_turn = commands.add_parser(
        "multi-turn", conflict_handler="resolve",
        help="N concurrent multi-turn conversations against a server or an in-process engine",
        description="Shared system prefix, a unique context per conversation, history growing "
                    "each turn; reports TTFT, TPOT, tokens/s and per-tier KV hit rates. The "
                    "target is the server at --url, or with --engine in-process a kvtier engine "
                    "built in this process from the engine options (no HTTP).")
    workload = _add_workload_arguments(multi_turn)
    _add_common_arguments(multi_turn, workload,
                          seed_help="seed of the conversations' text; an in-process engine also "
                                    "seeds its sampler with it (the workload decodes greedily)")
    trace = commands.add_parser(
        "trace", conflict_handler="resolve",
        help="replay a request trace (Mooncake JSON lines) on its own clock",
        description="Each trace request is sent at its (scaled) arrival time as token ids to "
                    "/v1/completions, its output exactly the trace's length (capped); the same "
                    "hash id always becomes the same tokens, so shared prefixes in the trace "
                    "are shared prompts. Reports TTFT, TPOT, tokens/s and per-tier KV hit rates, "
                    "against the server at --url or an in-process engine.")
    trace_group = add_trace_arguments(trace)
    _add_common_arguments(trace, trace_group,
                          seed_help="seed of the token ids that stand for the hash ids; an "
                                    "in-process engine also seeds its sampler with it",
                          with_api=False)


def _add_common_arguments(parser: argparse.ArgumentParser, workload: argparse._ArgumentGroup,
                          seed_help: str, with_api: bool = True) -> None:
    target = _add_target_arguments(parser, with_api)
    _add_output_arguments(parser)
    add_engine_args(parser, positional_model=False)
    # Added last: with conflict_handler="resolve" these replace the engine options of the same
    # names, so one --seed and one --model serve both targets.
    _add_shared_arguments(workload, target, seed_help)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
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
    group.add_argument("--start-interval", type=float, default=DEFAULTS.start_interval_s,
                       help="seconds between the first turns of consecutive conversations "
                            "(default 0: all conversations start at once)")
    return group


def _add_target_arguments(parser: argparse.ArgumentParser,
                          with_api: bool) -> argparse._ArgumentGroup:
    group = parser.add_argument_group(
        "target", description="engine options (below) apply with --engine in-process only")
    group.add_argument("--engine", choices=ENGINES, default="server",
                       help="server (default): the OpenAI-compatible server at --url; "
                            "in-process: a kvtier engine built in this process from the engine "
                            "options, driven without HTTP")
    group.add_argument("--url", default=None,
                       help=f"the server to benchmark (default {TARGET_DEFAULTS.url}); server "
                            "target only")
    if with_api:
        group.add_argument("--api", choices=("chat", "completions", "responses", "messages"),
                           default=TARGET_DEFAULTS.api,
                           help="request shape; in-process runs the server's code for the same "
                                "endpoint (chat template or plain prompt); responses (server "
                                "only) sends each turn's new messages with the "
                                "previous_response_id of the conversation's last turn; "
                                "messages (server only) is Anthropic's Messages API")
    else:
        parser.set_defaults(api="completions")
    group.add_argument("--request-timeout", type=float, default=TARGET_DEFAULTS.request_timeout_s)
    group.add_argument("--run-timeout", type=float, default=TARGET_DEFAULTS.run_timeout_s)
    return group


def _add_shared_arguments(workload: argparse._ArgumentGroup, target: argparse._ArgumentGroup,
                          seed_help: str) -> None:
    workload.add_argument("--seed", type=int, default=DEFAULTS.seed, help=seed_help)
    target.add_argument("--model", default=None,
                        help="server: the model name to request (default: the first the "
                             "server lists); in-process: HF model directory or .gguf file "
                             "(default: SmolLM2-135M)")


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
    from kvtier.entrypoints.bench.client import BenchClientError
    from kvtier.entrypoints.bench.runner import BenchTimeoutError

    if args.output_plot is not None:
        require_matplotlib()
    check_output_path(args.output_json, "--output-json")
    check_output_path(args.output_plot, "--output-plot")
    try:
        if args.bench_command == "trace":
            return run_trace_command(args, _target(args))
        return _run_multi_turn(args)
    except (BenchClientError, BenchTimeoutError) as exc:
        print(f"kvtier bench {args.bench_command}: error: {exc}", file=sys.stderr)
        return 1


def _run_multi_turn(args: argparse.Namespace) -> int:
    from kvtier.entrypoints.bench.report import emit_report
    from kvtier.entrypoints.bench.runner import run_multi_turn

    config = MultiTurnConfig(
        num_conversations=args.num_conversations, num_turns=args.num_turns,
        system_prompt_tokens=args.system_prompt_tokens, context_tokens=args.context_tokens,
        user_tokens=args.user_tokens, output_tokens=args.output_tokens,
        think_time_s=args.think_time, start_interval_s=args.start_interval, seed=args.seed)
    target = _target(args)
    report = asyncio.run(run_multi_turn(config, target, label=args.label,
                                        show_progress=not args.no_progress))
    return emit_report(report, args.output_json, args.output_plot, _write_plot)


def _write_plot(report: dict, path: Path) -> None:
    from kvtier.entrypoints.bench.plot import write_plot  # matplotlib: only when plotting
    write_plot(report, path)


def _target(args: argparse.Namespace) -> BenchTarget:
    """Raises ValueError naming an option that does not fit the chosen target."""
    if args.engine == "in-process":
        if args.url is not None:
            raise ValueError("--url names a server, but --engine in-process runs the engine in "
                             "this process; leave --url out")
        return EngineTarget(engine=engine_config_from_args(args), api=args.api,
                            request_timeout_s=args.request_timeout,
                            run_timeout_s=args.run_timeout)
    for dest, (flag, default) in _engine_only_options().items():
        if getattr(args, dest) != default:
            raise ValueError(f"{flag} configures an in-process engine; add --engine in-process, "
                             "or leave it out to benchmark the server at --url")
    return ServerTarget(url=args.url or TARGET_DEFAULTS.url, model=args.model, api=args.api,
                        request_timeout_s=args.request_timeout, run_timeout_s=args.run_timeout)


def _engine_only_options() -> dict[str, tuple[str, Any]]:
    """dest -> (flag, default) of the engine options a server run has no use for."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe, positional_model=False)
    # argparse has no public list of a parser's options; `_actions` has been stable for years.
    return {action.dest: (action.option_strings[0], action.default)
            for action in probe._actions if action.dest not in _SHARED_OPTIONS}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m kvtier.entrypoints.bench.cli BENCHMARK ...`), same as
    `kvtier bench BENCHMARK ...`."""
    from kvtier.entrypoints.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
