"""`kvtier generate PROMPT...`: run the engine offline and print each completion."""

from __future__ import annotations

import argparse

from kvtier.engine.args import add_engine_args, engine_config_from_args
from kvtier.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text prompt(s)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user message in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 1 discourages repeating the prompt's and generated tokens "
                             "(1: off)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(parser, positional_model=False)


def run(args: argparse.Namespace) -> int:
    # SamplingParams and the config validate here, before the model loads.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k,
                            repetition_penalty=args.repetition_penalty, stop=args.stop)
    config = engine_config_from_args(args)
    from kvtier.engine.llm import LLM
    llm = LLM.from_config(config)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for output in outputs:
        print(output.outputs[0].text, flush=True)
    llm.shutdown()
    return 0
