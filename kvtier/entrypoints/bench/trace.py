"""Request traces in the Mooncake format, and their scaled replay as token-id prompts.

One JSON object per line: `timestamp` (ms from the trace's start), `input_length` and
`output_length` (tokens), `hash_ids` (the prompt's blocks of TRACE_BLOCK_TOKENS tokens as prefix
hashes: equal ids at the same position are the same prefix block; the last block may be partial).

A replay turns each hash id into a fixed run of token ids, drawn from a generator seeded by the id
alone, so equal prefixes of hash ids become equal prompts whatever order the requests come in.
The scaling (tokens per block, time, output cap) is explicit in TraceScaling and in the report.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Tokens per hash id in the Mooncake traces.
TRACE_BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace line that does not follow the format (names the file, the line and the fix)."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace, unscaled."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScaling:
    """How a trace is replayed on a smaller model or clock.

    `tokens_per_block` tokens stand for each hash id (the trace's own TRACE_BLOCK_TOKENS by
    default; fewer scales every prompt down by the same factor, the last partial block in
    proportion). Inter-arrival times are multiplied by `time_scale`. The replay starts at the
    `first_request`-th request in arrival order (0: the first; its caches start cold, as they
    would at that point of a restart) and takes `max_requests` of them (None: every one
    after). Output lengths are the trace's, capped at `max_output_tokens` (None: uncapped).
    Token ids are drawn from [0, vocab_size) (None: the target model's vocabulary), `seed`
    picks another family of prompts with the same prefix structure.
    """

    tokens_per_block: int = TRACE_BLOCK_TOKENS
    time_scale: float = 1.0
    max_requests: int | None = None
    max_output_tokens: int | None = None
    vocab_size: int | None = None
    seed: int = 0
    first_request: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.tokens_per_block >= 1, "tokens_per_block", "must be >= 1"),
            (math.isfinite(self.time_scale) and self.time_scale >= 0.0, "time_scale",
             "must be a finite number >= 0"),
            (self.max_requests is None or self.max_requests >= 1, "max_requests",
             "must be >= 1 or None"),
            (self.first_request >= 0, "first_request", "must be >= 0"),
            (self.max_output_tokens is None or self.max_output_tokens >= 1,
             "max_output_tokens", "must be >= 1 or None"),
            (self.vocab_size is None or self.vocab_size >= 2, "vocab_size",
             "must be >= 2 or None"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"TraceScaling.{name} {rule}, got {getattr(self, name)!r}")

    def describe(self) -> str:
        """One line a person reads before the run starts."""
        output = ("trace output lengths" if self.max_output_tokens is None
                  else f"output lengths capped at {self.max_output_tokens}")
        start = f", from request {self.first_request}" if self.first_request else ""
        return (f"trace scaling: {self.tokens_per_block} tokens per hash id (trace: "
                f"{TRACE_BLOCK_TOKENS}, prompts x{self.tokens_per_block / TRACE_BLOCK_TOKENS:g}), "
                f"inter-arrival times x{self.time_scale:g}, {output}{start}")


@dataclass(frozen=True)
class ScaledRequest:
    """One request as it is replayed: when, what prompt, how many output tokens."""

    index: int
    arrival_s: float  # from the replay's start
    hash_ids: tuple[int, ...]
    num_prompt_tokens: int
    output_tokens: int


def load_trace(path: Path) -> list[TraceRequest]:
    """Every request of a trace file, in file order; TraceFormatError on a malformed line."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"cannot read the trace {path}: {exc}") from exc
    requests = [_parse_line(path, number, line)
                for number, line in enumerate(lines, start=1) if line.strip()]
    if not requests:
        raise TraceFormatError(f"trace {path} holds no request; give a JSON-lines file")
    return requests


def _finite(where: str, name: str, value: object) -> float:
    # JSON's NaN and Infinity parse as numbers; no arrival time can be either.
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise TraceFormatError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


def _integer(where: str, name: str, value: object) -> int:
    # A float id would be cut to another block's (1.9 -> 1); 1024.0 is taken as 1024.
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float)
                                       and value.is_integer()):
        raise TraceFormatError(f"{where}: {name} must hold integers, got {value!r}")
    return int(value)


def _list(where: str, value: object) -> list:
    if not isinstance(value, list):
        raise TraceFormatError(f"{where}: hash_ids must be a list of integers, got {value!r}")
    return value


def _parse_line(path: Path, number: int, line: str) -> TraceRequest:
    where = f"trace {path} line {number}"
    try:
        item = json.loads(line)
        fields = [item[name] for name in ("timestamp", "input_length", "output_length",
                                          "hash_ids")]
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"{where}: not a trace record ({exc!r}); each line needs "
                               "timestamp, input_length, output_length and hash_ids") from exc
    request = TraceRequest(_finite(where, "timestamp", fields[0]),
                           _integer(where, "input_length", fields[1]),
                           _integer(where, "output_length", fields[2]),
                           tuple(_integer(where, "hash_ids", h) for h in _list(where, fields[3])))
    num_blocks = len(request.hash_ids)
    if num_blocks == 0:
        raise TraceFormatError(f"{where}: hash_ids is empty; a request has at least one block")
    if not TRACE_BLOCK_TOKENS * (num_blocks - 1) < request.input_length \
            <= TRACE_BLOCK_TOKENS * num_blocks:
        raise TraceFormatError(
            f"{where}: input_length {request.input_length} does not fit {num_blocks} hash ids "
            f"of {TRACE_BLOCK_TOKENS} tokens; the last block may be partial, no other")
    if request.timestamp_ms < 0 or request.output_length < 0 or min(request.hash_ids) < 0:
        raise TraceFormatError(f"{where}: timestamp, output_length and hash_ids must be >= 0")
    return request


def scale_trace(requests: list[TraceRequest], scaling: TraceScaling) -> list[ScaledRequest]:
    """The requests to replay, sorted by arrival (ties keep file order)."""
    first = scaling.first_request
    end = None if scaling.max_requests is None else first + scaling.max_requests
    chosen = sorted(requests, key=lambda r: r.timestamp_ms)[first:end]
    if not chosen:
        raise ValueError(f"first_request {first} is past the trace's {len(requests)} requests; "
                         "give a smaller --first-request")
    start_ms = chosen[0].timestamp_ms
    return [
        ScaledRequest(
            index=index,
            arrival_s=(request.timestamp_ms - start_ms) / 1000.0 * scaling.time_scale,
            hash_ids=request.hash_ids,
            num_prompt_tokens=scaled_prompt_length(request, scaling.tokens_per_block),
            output_tokens=_scaled_output(request.output_length, scaling.max_output_tokens),
        )
        for index, request in enumerate(chosen)
    ]


def scaled_prompt_length(request: TraceRequest, tokens_per_block: int) -> int:
    """Full blocks count `tokens_per_block`; the partial last one its share of it, at least 1."""
    last = request.input_length - TRACE_BLOCK_TOKENS * (len(request.hash_ids) - 1)
    scaled_last = max(1, math.ceil(last * tokens_per_block / TRACE_BLOCK_TOKENS))
    return tokens_per_block * (len(request.hash_ids) - 1) + scaled_last


def _scaled_output(output_length: int, cap: int | None) -> int:
    # max_tokens must be >= 1; a trace's 0 becomes the shortest request a server takes.
    capped = output_length if cap is None else min(output_length, cap)
    return max(1, capped)


class BlockTokens:
    """The token ids that stand for each hash id (same id -> same ids), cached per run."""

    def __init__(self, tokens_per_block: int, vocab_size: int, seed: int = 0) -> None:
        self.tokens_per_block = tokens_per_block
        self.vocab_size = vocab_size
        self.seed = seed
        self._cache: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        tokens = self._cache.get(hash_id)
        if tokens is None:
            # Seeded by (seed, id) only: the tokens do not depend on which request asks first.
            rng = np.random.default_rng([self.seed, hash_id])
            tokens = rng.integers(0, self.vocab_size, self.tokens_per_block).tolist()
            self._cache[hash_id] = tokens
        return tokens

    def prompt(self, request: ScaledRequest) -> list[int]:
        """The prompt's token ids: one block per hash id, cut to the scaled length."""
        token_ids = [t for hash_id in request.hash_ids for t in self.block(hash_id)]
        return token_ids[:request.num_prompt_tokens]
