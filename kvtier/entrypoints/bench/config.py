"""Configuration of the multi-turn benchmark: the workload's shape and the target it drives
(an OpenAI-compatible server, or a kvtier engine built in the benchmark's own process)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvtier.common.urls import check_http_url
from kvtier.config import EngineConfig

ApiKind = Literal["chat", "completions", "responses", "messages"]


@dataclass(frozen=True)
class MultiTurnConfig:
    """Shape of the multi-turn workload (issue 7).

    Every conversation's first message is the shared system prefix followed by a context unique to
    that conversation; each turn then appends a new user message, and the server's reply joins the
    history, so the prompt of turn t holds everything said in turns 0..t-1. Lengths are in tokens
    of the fixed word list (see words.py).
    """

    num_conversations: int = 8
    num_turns: int = 4
    system_prompt_tokens: int = 512
    context_tokens: int = 512
    user_tokens: int = 64
    output_tokens: int = 32
    think_time_s: float = 0.0
    # Conversation i sends its first turn i * start_interval_s after the run starts (users
    # arriving over time); 0: all at once, so every first turn queues behind the others.
    start_interval_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.num_conversations >= 1, "num_conversations", "must be >= 1"),
            (self.num_turns >= 1, "num_turns", "must be >= 1"),
            (self.system_prompt_tokens >= 0, "system_prompt_tokens", "must be >= 0"),
            (self.context_tokens >= 0, "context_tokens", "must be >= 0"),
            (self.user_tokens >= 1, "user_tokens", "must be >= 1"),
            (self.output_tokens >= 1, "output_tokens", "must be >= 1"),
            (0.0 <= self.think_time_s < math.inf, "think_time_s", "must be finite and >= 0"),
            (0.0 <= self.start_interval_s < math.inf, "start_interval_s",
             "must be finite and >= 0"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"MultiTurnConfig.{name} {rule}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ServerTarget:
    """An OpenAI-compatible server to benchmark.

    `model` None: the first model the server lists on /v1/models. `request_timeout_s` bounds each
    request from send to last byte; `run_timeout_s` bounds the whole run.
    """

    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api: ApiKind = "chat"
    request_timeout_s: float = 300.0
    run_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        check_http_url(self.url, "ServerTarget.url (--url)")
        _check_api_and_timeouts("ServerTarget", self.api, self.request_timeout_s,
                                self.run_timeout_s)

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")


@dataclass(frozen=True)
class EngineTarget:
    """A kvtier engine built in the benchmark's process and driven without HTTP.

    The requests are the ones the server target sends (same bodies, `api` picks chat or
    completions) and go through the server's own prompt and sampling code to an AsyncLLM, so the
    two targets differ only by the HTTP hop. The timeouts mean what they mean for ServerTarget.
    """

    engine: EngineConfig
    api: ApiKind = "chat"
    request_timeout_s: float = 300.0
    run_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError("EngineTarget.engine must be an EngineConfig (build one with "
                             f"EngineConfig.create(...)), got {type(self.engine).__name__}")
        _check_api_and_timeouts("EngineTarget", self.api, self.request_timeout_s,
                                self.run_timeout_s)


def _check_api_and_timeouts(target: str, api: str, request_timeout_s: float,
                            run_timeout_s: float) -> None:
    """ValueError naming the field and its flag. A NaN timeout passes any `<=` test and then
    bounds nothing; an infinite one bounds nothing either."""
    apis = ("chat", "completions", "responses", "messages") if target == "ServerTarget" \
        else ("chat", "completions")  # the in-process engine stores no responses
    if api not in apis:
        names = [repr(name) for name in apis]
        raise ValueError(f"{target}.api must be {', '.join(names[:-1])} or {names[-1]} (--api), "
                         f"got {api!r}")
    for field, flag, seconds in (("request_timeout_s", "--request-timeout", request_timeout_s),
                                 ("run_timeout_s", "--run-timeout", run_timeout_s)):
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"{target}.{field} must be a finite number of seconds > 0 "
                             f"({flag}), got {seconds}")


BenchTarget = ServerTarget | EngineTarget
