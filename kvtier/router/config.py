"""The router's options, checked once at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.common.options import check_positive_seconds
from kvtier.common.urls import check_http_url

PREFILL_TIMEOUT_S = 60.0
# The options in seconds, by their flag (those with none named as the field).
_SECONDS_FLAGS = {"health_interval_s": "--health-interval", "event_timeout_s": "event_timeout_s",
                  "connect_timeout_s": "connect_timeout_s", "read_timeout_s": "--read-timeout",
                  "prefill_timeout_s": "--prefill-timeout"}

Policy = Literal["kv-aware", "round-robin", "least-loaded"]
POLICIES: tuple[Policy, ...] = ("kv-aware", "round-robin", "least-loaded")


@dataclass(frozen=True)
class TierWeights:
    """What one cached block is worth, by where it lives: loading it from a slower tier saves
    less of its prefill. A block on a shared (remote) store counts for every instance."""

    gpu: float = 1.0
    cpu: float = 0.8
    disk: float = 0.5
    remote: float = 0.3


@dataclass(frozen=True)
class RouterConfig:
    # Instance mode: each request goes to one of these, prompt and answer.
    instances: tuple[str, ...] = ()
    # P/D mode: each prompt is computed on a prefill instance, whose KV a decode instance loads
    # to answer the request (both run the P2PConnector).
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    policy: Policy = "kv-aware"
    # Model (HF directory or .gguf) whose tokenizer the router uses; None: the instances'.
    model: str | None = None
    # Blocks the index remembers, least recently stored forgotten first.
    index_max_blocks: int = 1_000_000
    # Requests in flight (or queued) at which an instance counts as saturated: kv-aware routing
    # passes it over while another instance is below it, however much it has cached.
    saturation: int = 16
    # Prompt tokens of work one request of load adds to kv-aware routing's estimate of an
    # instance's time to first token: its decode steps, or a prompt the router did not send.
    load_weight_tokens: int = 64
    tier_weights: TierWeights = TierWeights()
    health_interval_s: float = 1.0
    # Failed health checks in a row after which an instance is dropped (retried every interval).
    max_health_failures: int = 2
    # An instance that served a request and published nothing for this long is taken out of the
    # index until its events flow again.
    event_timeout_s: float = 10.0
    # Instances one request is tried on before its error goes back to the client.
    max_attempts: int = 3
    connect_timeout_s: float = 5.0
    # Longest wait for a prefill instance's answer; past it the decode instance computes the
    # prompt itself.
    prefill_timeout_s: float = PREFILL_TIMEOUT_S
    # P/D mode: a prompt of which the decode instance lacks at most this many tokens (by the
    # index) is computed there, with no prefill instance: a short prompt or a later turn costs
    # that instance less than waiting behind long prompts for a prefill. 0: every prompt goes
    # to a prefill instance.
    local_prefill_tokens: int = 0
    # Longest wait for an instance's next bytes (a whole answer, when not streamed); past it the
    # client gets a 504 and the instance, still healthy, drops the request.
    read_timeout_s: float = 600.0
    # Sent as a bearer token on the router's own calls to the instances' /v1 endpoints (KV
    # events and transfer info) when they serve with --api-key. Clients' requests carry their
    # own Authorization header through.
    instance_api_key: str | None = None

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.decode)

    @property
    def all_urls(self) -> tuple[str, ...]:
        return self.instances + self.prefill + self.decode

    def __post_init__(self) -> None:
        self._check_urls()
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("index_max_blocks", "saturation", "max_health_failures", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        self._check_pd_options()
        if self.load_weight_tokens < 0:
            raise ValueError(f"--load-weight-tokens must be >= 0, got {self.load_weight_tokens}")
        if self.instance_api_key == "":
            raise ValueError("--instance-api-key must not be empty; leave it out when the "
                             "instances serve without a key")
        for name, flag in _SECONDS_FLAGS.items():
            check_positive_seconds(getattr(self, name), flag)

    def _check_pd_options(self) -> None:
        if self.local_prefill_tokens < 0:
            raise ValueError("--local-prefill-tokens must be >= 0, got "
                             f"{self.local_prefill_tokens}")
        if not self.is_disaggregated:
            # Instance mode has no prefill instance to wait for or to skip: a flag that would
            # be ignored is refused instead.
            for value, default, flag in (
                    (self.local_prefill_tokens, 0, "--local-prefill-tokens"),
                    (self.prefill_timeout_s, PREFILL_TIMEOUT_S, "--prefill-timeout")):
                if value != default:
                    raise ValueError(f"{flag} is for P/D mode (--prefill and --decode URLs); "
                                     "drop it in instance mode")
        if self.local_prefill_tokens and self.policy != "kv-aware":
            raise ValueError("--local-prefill-tokens needs --policy kv-aware: the router counts "
                             "a prompt's uncached tokens with its KV index")

    def _check_urls(self) -> None:
        if self.instances and (self.prefill or self.decode):
            raise ValueError("give --instance URLs, or --prefill and --decode URLs, not both")
        if not self.instances and not (self.prefill and self.decode):
            raise ValueError("give at least one --instance URL (e.g. --instance "
                             "http://127.0.0.1:8000), or at least one --prefill URL and one "
                             "--decode URL")
        for flag, urls in (("--instance", self.instances), ("--prefill", self.prefill),
                           ("--decode", self.decode)):
            for url in urls:
                check_http_url(url, flag)
        if len(set(self.all_urls)) != len(self.all_urls):
            raise ValueError("instance URLs must be distinct (an instance is either a prefill "
                             "or a decode one)")


