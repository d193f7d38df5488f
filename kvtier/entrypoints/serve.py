"""`kvtier serve [MODEL]`: the OpenAI-compatible server on uvicorn.

SIGTERM / Ctrl-C: uvicorn stops accepting connections and lets in-flight requests finish (up to
--shutdown-timeout), then the engine drains what is left and stops.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from kvtier.common.options import check_positive_seconds
from kvtier.common.sizes import parse_size
from kvtier.config import EngineConfig
from kvtier.engine.args import add_engine_args, engine_config_from_args
from kvtier.models.chat import read_chat_template

if TYPE_CHECKING:
    from kvtier.engine.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# The engine thread releases the GIL inside every torch op and must take it back after each one
# (hundreds per step). Under Python's default 5 ms interval, an op ending while the HTTP loop or an
# offload thread runs Python waits up to 5 ms for the GIL; 0.5 ms cut the median decode step at
# 128 conversations from 189-214 to 166-171 ms (on the 2-core VM of docs/benchmarks.md).
DEFAULT_SWITCH_INTERVAL_S = 0.0005

# The tool call formats --tool-call-parser may name (kvtier/entrypoints/openai/tools.py), and
# the thinking formats --reasoning-parser may name (kvtier/entrypoints/openai/reasoning.py).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes it)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 requests")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use (default: the model argument)")
    group.add_argument("--kv-events-config", default=None,
                       help='KV event publishing as JSON, vLLM\'s shape, e.g. '
                            '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                            '"endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}\'')
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens (off by default: "
                            "on a shared server it tells a client how much of its prompt "
                            "matched earlier requests, perhaps another client's)")
    group.add_argument("--generation-config", default="auto",
                       help="sampling defaults (temperature, top_p, top_k, min_p, "
                            "repetition_penalty) for requests that leave them unset: 'auto' "
                            "(default) reads the model directory's generation_config.json, "
                            "'vllm' uses none, or a directory holding a generation_config.json")
    group.add_argument("--max-request-body-bytes", default="8MiB",
                       help="largest request body accepted, e.g. 8MiB (default) or 1048576; "
                            "larger ones get a 413 before they are read")
    group.add_argument("--responses-store-size", default="128MiB",
                       help="memory for responses kept for previous_response_id and GET "
                            "/v1/responses/{id}, e.g. 128MiB (default); the least recently "
                            "used go first; 0 keeps none")
    group.add_argument("--uvicorn-log-level", default="info", choices=_LOG_LEVELS)
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish at shutdown; the engine "
                            "then stops, writing write-back tiers' chunks out, so keep it "
                            "below a supervisor's grace period (Kubernetes: 30 s) with room "
                            "for that")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) to load at start-up, with "
                            "--enable-lora; a request's `model` names one. Also "
                            '\'{"name": NAME, "path": PATH}\'. With '
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in the environment, "
                            "POST /v1/load_lora_adapter and /v1/unload_lora_adapter change "
                            "them at run time")
    group.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                       help="with --enable-lora: a directory of LoRA adapters, one per "
                            "subdirectory; a request whose model names one loads it (as vLLM's "
                            "filesystem resolver); see --max-cpu-loras to bound how many stay "
                            "loaded")
    group.add_argument("--switch-interval", type=float, default=DEFAULT_SWITCH_INTERVAL_S,
                       help="Python's thread switch interval in seconds for the server process "
                            f"(default {DEFAULT_SWITCH_INTERVAL_S}; Python's own is 0.005): how "
                            "long the engine thread can wait for the GIL after a torch op")
    _add_chat_arguments(parser)


def _add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("chat")
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template for /v1/chat/completions, or the path of a "
                            "file holding one (default: the model's)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let chat requests with tools use tool_choice "auto" (the '
                            "default with tools): the model decides, and --tool-call-parser "
                            "finds its calls in the text")
    group.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                       help="how the model writes tool calls, for --enable-auto-tool-choice: "
                            "hermes (<tool_call>{\"name\": ..., \"arguments\": ...}"
                            "</tool_call>, as Qwen and Hermes models write them) or "
                            "llama3_json (the answer is {\"name\": ..., \"parameters\": ...}, "
                            "several joined by ';', as Llama 3.1-3.3 write them)")
    group.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="a reasoning model's thinking (<think>...</think>) goes to the chat "
                            "message's `reasoning`, the rest to `content`: deepseek_r1 (the "
                            "output thinks until </think>; DeepSeek-R1, QwQ, Qwen3 thinking "
                            "models) or qwen3 (only when it opens with <think>)")


def _checked_config(args: argparse.Namespace
                    ) -> tuple[EngineConfig, int, KVEventsConfig | None,
                               list[tuple[str, str, str | None]]]:
    """The engine config, the request body limit in bytes, the KV events config and the
    LoRA modules, every server option checked; imports no torch (unless --device names one),
    so a bad value fails before the heavy imports."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_positive_seconds(args.shutdown_timeout, "--shutdown-timeout")
    if args.api_key == "":
        # Any client sending an empty key ("Authorization: Bearer ") would get in.
        raise ValueError("--api-key must not be empty; leave it out to serve without a key")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: give "
                         "both (e.g. --enable-auto-tool-choice --tool-call-parser hermes) or "
                         "neither")
    if not 0 < args.switch_interval <= 1:
        raise ValueError(f"--switch-interval must be in (0, 1] seconds, got {args.switch_interval}")
    max_body = parse_size(args.max_request_body_bytes, "--max-request-body-bytes")
    if max_body <= 0:
        raise ValueError(f"--max-request-body-bytes must be > 0, got {max_body}")
    parse_size(args.responses_store_size, "--responses-store-size")
    config = engine_config_from_args(args)
    lora_modules = parse_lora_modules(args.lora_modules)
    for flag, given in (("--lora-modules", lora_modules),
                        ("--lora-resolver-dir", args.lora_resolver_dir)):
        if given and not config.lora.enable_lora:
            raise ValueError(f"{flag} needs --enable-lora")
    if args.lora_resolver_dir is not None and not os.path.isdir(args.lora_resolver_dir):
        raise ValueError(f"--lora-resolver-dir {args.lora_resolver_dir}: no such directory")
    events_config = None
    if args.kv_events_config is not None:
        from kvtier.engine.kv_events import KVEventsConfig

        events_config = KVEventsConfig.from_json(args.kv_events_config)
        if events_config.enable_kv_cache_events:
            config = dataclasses.replace(config, cache=dataclasses.replace(
                config.cache, enable_kv_cache_events=True))
    check_listen_address(args.host, args.port)
    return config, max_body, events_config, lora_modules


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries, each NAME=PATH or a JSON object {"name", "path"[,
    "base_model_name"]}, as (name, path, base model name or None). ValueError naming the bad
    entry."""
    modules: list[tuple[str, str, str | None]] = []
    for value in values or ():
        base = None
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON ({exc})") from None
            unknown = set(entry) - {"name", "path", "base_model_name"} \
                if isinstance(entry, dict) else {"?"}
            name, path = (entry.get("name"), entry.get("path")) if not unknown else (None, None)
            base = entry.get("base_model_name") if not unknown else None
        else:
            name, _, path = value.partition("=")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path \
                or not isinstance(base, (str, type(None))):
            raise ValueError(f"--lora-modules {value!r}: give NAME=PATH or "
                             '{"name": NAME, "path": PATH[, "base_model_name": NAME]}')
        if name in (m[0] for m in modules):
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules.append((name, path, base))
    return modules


def check_listen_address(host: str, port: int) -> None:
    """Bind HOST:PORT once and let go: an address that does not resolve, is not this machine's,
    or is taken fails now, not after the model has loaded. Reuse-address as uvicorn binds, so
    a port in TIME_WAIT from a server just stopped passes as it will there."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host!r} does not resolve to an address ({exc}); give an "
                         "IP address such as 127.0.0.1 or 0.0.0.0, or a name this machine "
                         "resolves") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            # Lower case as uvicorn words it: what watches a log for "address already in use"
            # sees it from either.
            reason = (exc.strerror or str(exc)).lower()
            raise ValueError(f"cannot listen on --host {host} --port {port}: {reason}; give "
                             "an address of this machine and a free port") from None


def _kv_events_info(events: KVEventsConfig | None, config: EngineConfig,
                    chat_template: str | None) -> dict[str, Any] | None:
    """What a router needs to follow this server's KV cache: the event sockets, and the model
    and block hashing to tokenize and hash prompts as the engine does."""
    if events is None or not events.is_publishing:
        return None
    from kvtier.models.loader import default_model_path

    return {"publishing": True, "endpoint": events.endpoint,
            "replay_endpoint": events.replay_endpoint, "topic": events.topic,
            "block_size": config.cache.block_size, "hash_algo": config.cache.hash_algo,
            "model": os.path.abspath(config.model.model or default_model_path()),
            "chat_template": chat_template}


def run(args: argparse.Namespace) -> int:
    config, max_body, events_config, lora_modules = _checked_config(args)
    chat_template = None if args.chat_template is None else read_chat_template(args.chat_template)
    import uvicorn

    from kvtier.common.cpu_threads import use_one_cpu_thread
    from kvtier.engine.async_llm import AsyncLLM
    from kvtier.engine.engine import Engine
    from kvtier.engine.kv_events import make_event_publisher
    from kvtier.entrypoints.openai.app import build_app
    from kvtier.entrypoints.openai.context import ServerContext, ServerMetrics
    from kvtier.entrypoints.openai.responses.store import ResponseStore
    from kvtier.models.generation_config import load_sampling_defaults

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sampling_defaults = load_sampling_defaults(args.generation_config, config.model.model)
    if sampling_defaults:
        logger.info("requests that leave them unset sample with %s (from the generation config; "
                    "--generation-config vllm for none)", sampling_defaults)
    # Bind the event socket before loading the model: a taken port fails fast.
    publisher = make_event_publisher(events_config)
    try:
        async_llm = AsyncLLM(lambda: Engine(config), publisher)
    except BaseException:
        publisher.shutdown()  # its thread holds the port until stopped
        raise
    engine = async_llm.engine
    publisher.count_lost_in(engine.metrics)
    model_arg = config.model.model
    names = tuple(args.served_model_name or [model_arg or engine.model_name])
    try:
        thinking = _set_up_tokenizer(engine.tokenizer, chat_template, args.reasoning_parser)
        loras = _load_lora_modules(engine, lora_modules, names)
    except ValueError:  # a template that does not parse, an adapter that does not load, too
        async_llm.shutdown(0.0)
        raise
    ctx = ServerContext(async_llm, names, model_arg, args.api_key,
                        ServerMetrics(engine.metrics),
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        thinking_token_ids=thinking,
                        kv_events_info=_kv_events_info(events_config, config, chat_template),
                        sampling_defaults=sampling_defaults, lora_modules=loras,
                        lora_parents={name: base for name, _, base in lora_modules if base},
                        lora_resolver_dir=args.lora_resolver_dir,
                        response_store=ResponseStore(parse_size(args.responses_store_size,
                                                                 "--responses-store-size")))
    app = build_app(ctx, shutdown_timeout_s=args.shutdown_timeout,
                    max_request_body_bytes=max_body)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout))  # asyncio.timeout takes a float
    logger.info("serving %s on http://%s:%d", names[0], args.host, args.port)
    sys.setswitchinterval(args.switch_interval)
    use_one_cpu_thread()  # the HTTP loop's torch ops (if any) start no OpenMP team
    freeze_startup_objects()
    return _serve_until_stopped(server, async_llm)


def _set_up_tokenizer(tokenizer: Any, chat_template: str | None,
                      reasoning_parser: str | None) -> tuple[int, int] | None:
    """Give the tokenizer --chat-template; the ids of the thinking tokens --reasoning-parser
    reads (None without one). ValueError for a model that cannot take them."""
    if chat_template is not None:
        if tokenizer is None:
            raise ValueError("--chat-template: this model has no tokenizer to render chats")
        tokenizer.set_chat_template(chat_template)
    if reasoning_parser is None:
        return None
    from kvtier.entrypoints.openai.reasoning import thinking_tokens

    return thinking_tokens(tokenizer, reasoning_parser)


def _load_lora_modules(engine: Any, modules: list[tuple[str, str, str | None]],
                       served: tuple[str, ...]) -> dict[str, Any]:
    """--lora-modules loaded into the engine: name -> LoRARequest."""
    from kvtier.lora import LoRARequest

    loras = {}
    for index, (name, path, _) in enumerate(modules):
        if name in served:
            raise ValueError(f"--lora-modules {name!r} is also a served model name")
        loras[name] = LoRARequest(name, index + 1, path)
        engine.load_lora(loras[name])
        logger.info("LoRA adapter %s loaded from %s", name, path)
    return loras


def _serve_until_stopped(server: Any, async_llm: Any) -> int:
    """Run the HTTP server; the exit status."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started in the background by a shell (which ignores SIGINT for it): uvicorn stops on
        # SIGINT all the same, then raises it again under the handler it found, which would
        # swallow it and exit 0 instead of 130.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it handled again once it has stopped
        return 130
    finally:
        # Already done by the app's shutdown unless a second Ctrl-C forced uvicorn out before
        # it: the engine's own shutdown is what writes write-back tiers' chunks out.
        async_llm.shutdown(0.0)
    return 0


def freeze_startup_objects() -> None:
    """Collect once, then put every object alive now out of the cyclic collector's reach.
    Startup leaves ~300k objects the collector tracks (torch's and the model's modules, the
    tokenizer, the app) that live as long as the server: every full collection would walk them
    all, ~150-270 ms on whichever thread allocates at that moment, often the engine thread in
    the middle of a step (measured on the VM of docs/benchmarks.md). Frozen, a full collection
    walks only what serving made. The library (`LLM`) does not do this: it shares its process
    with the caller's objects."""
    gc.collect()
    gc.freeze()
