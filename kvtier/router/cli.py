"""`kvtier router --instance URL [--instance URL ...]`: a KV-cache-aware router in front of
kvtier instances, OpenAI-compatible (the instances serve with --kv-events-config so the router
can follow their caches, and --enable-prompt-tokens-details for its predicted-vs-actual
metrics). `kvtier router --prefill URL ... --decode URL ...`: the same front-end in P/D mode,
prompts computed on prefill instances and answered by decode instances (P2PConnector)."""

from __future__ import annotations

import argparse
import logging

from kvtier.common.options import check_positive_seconds
from kvtier.common.sizes import parse_size
from kvtier.router.config import (
    POLICIES,
    PREFILL_TIMEOUT_S,
    RouterConfig,
)

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance", action="append", default=[], metavar="URL",
                        help="a kvtier instance, e.g. http://127.0.0.1:8000 (repeat for each)")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="P/D mode: an instance that computes prompts and sends their KV "
                             "(P2PConnector kv_producer; repeat for each; needs --decode)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="P/D mode: an instance that loads a prompt's KV from a prefill "
                             "instance and answers the request (P2PConnector kv_consumer; "
                             "repeat for each; needs --prefill)")
    parser.add_argument("--prefill-timeout", type=float, default=PREFILL_TIMEOUT_S,
                        help="P/D mode: seconds a prefill instance gets to compute a prompt; "
                             "past it the decode instance computes it itself (default 60)")
    parser.add_argument("--local-prefill-tokens", type=int, default=0,
                        help="P/D mode: a prompt of which the chosen decode instance lacks at "
                             "most this many tokens (by the KV index) is computed there, without "
                             "a prefill instance (default 0: every prompt goes to one)")
    parser.add_argument("--policy", default="kv-aware", choices=POLICIES,
                        help="kv-aware (default): the instance with the least prefill work "
                             "before this request's first token (prompt tokens queued there, "
                             "load, and this prompt less what it has cached); round-robin; "
                             "least-loaded")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--model", default=None,
                        help="model directory or .gguf file whose tokenizer hashes prompts "
                             "(default: the path the first instance reports)")
    parser.add_argument("--index-max-blocks", type=int, default=1_000_000,
                        help="blocks the KV index remembers, least recently stored forgotten "
                             "first (default 1000000)")
    parser.add_argument("--saturation", type=int, default=16,
                        help="requests in flight at which an instance counts as saturated and "
                             "kv-aware routing looks elsewhere (default 16)")
    parser.add_argument("--load-weight-tokens", type=int, default=64,
                        help="prompt tokens of work each request of load adds to an instance's "
                             "estimate in kv-aware routing (default 64)")
    parser.add_argument("--health-interval", type=float, default=1.0,
                        help="seconds between health and load checks of each instance")
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="instances a request is tried on before its error is returned")
    parser.add_argument("--read-timeout", type=float, default=600.0,
                        help="seconds an instance may send nothing (a whole answer, when not "
                             "streamed) before the client gets a 504 (default 600)")
    parser.add_argument("--instance-api-key", default=None,
                        help="the instances' --api-key, for the router's own calls to their /v1 "
                             "endpoints (KV events info); clients send theirs with each request")
    parser.add_argument("--max-request-body-bytes", default="8MiB",
                        help="largest request body accepted (default 8MiB)")
    parser.add_argument("--uvicorn-log-level", default="info", choices=_LOG_LEVELS)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish at shutdown (default 30)")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_positive_seconds(args.shutdown_timeout, "--shutdown-timeout")
    return RouterConfig(
        instances=tuple(args.instance), prefill=tuple(args.prefill), decode=tuple(args.decode),
        prefill_timeout_s=args.prefill_timeout,
        local_prefill_tokens=args.local_prefill_tokens, policy=args.policy, model=args.model,
        index_max_blocks=args.index_max_blocks, saturation=args.saturation,
        load_weight_tokens=args.load_weight_tokens, health_interval_s=args.health_interval,
        max_attempts=args.max_attempts, read_timeout_s=args.read_timeout,
        instance_api_key=args.instance_api_key)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    max_body = parse_size(args.max_request_body_bytes, "--max-request-body-bytes")
    if max_body <= 0:
        raise ValueError(f"--max-request-body-bytes must be > 0, got {max_body}")
    import uvicorn

    from kvtier.router.app import build_app
    from kvtier.router.service import RouterService

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    app = build_app(RouterService(config), max_request_body_bytes=max_body)
    logging.getLogger(__name__).info(
        "routing (%s) over %d instance(s), %d prefill, %d decode, on http://%s:%d", config.policy,
        len(config.instances), len(config.prefill), len(config.decode), args.host, args.port)
    # Past the timeout uvicorn drops what is still open (a client that stalls mid-body or
    # stops reading a stream would otherwise hold the exit forever).
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                  log_level=args.uvicorn_log_level,
                                  timeout_graceful_shutdown=args.shutdown_timeout)
                   ).run()
    return 0
