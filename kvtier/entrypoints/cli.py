"""`kvtier` command line: one subcommand per module, imported only when it is run."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

# name -> (module exposing add_arguments(parser) and run(args), one-line help)
SUBCOMMANDS = {
    "generate": ("kvtier.entrypoints.generate", "generate text offline for one or more prompts"),
    "serve": ("kvtier.entrypoints.serve", "run the OpenAI-compatible server"),
    "bench": ("kvtier.entrypoints.bench.cli", "run a benchmark client"),
    "router": ("kvtier.router.cli", "route requests over many instances by where their KV "
                                    "cache is"),
    "plan": ("kvtier.planner.cli", "size KV cache tiers for a request trace, by simulation"),
}
USAGE_ERROR = 2


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad input: one line naming the problem, exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="kvtier", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND",
                                       parser_class=OneLineErrorParser)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        # Importing a subcommand can pull in torch or FastAPI: only for the one being run.
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return USAGE_ERROR
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return module.run(args) or 0
    except ValueError as exc:
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as exc:  # a file or port the system refused: its own message says which
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
