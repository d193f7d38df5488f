"""What the router knows about each instance: health, load, and its KV event settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# "instance": serves whole requests; in P/D mode "prefill" computes prompts, "decode" answers.
Role = Literal["instance", "prefill", "decode"]


@dataclass(frozen=True)
class EventsInfo:
    """An instance's GET /v1/kv_events_info answer, checked."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int
    hash_algo: str
    model: str
    # The instance's --chat-template, when it overrides the model's.
    chat_template: str | None = None
    # Its LoRA adapters when it came up: name -> the key their block hashes carry.
    lora_adapters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> EventsInfo | None:
        """None when the instance publishes no events; ValueError when the answer is malformed."""
        if not isinstance(data, dict) or not data.get("publishing"):
            return None
        try:
            template = data.get("chat_template")
            adapters = data.get("lora_adapters") or {}
            if not all(isinstance(v, str) for v in (*adapters, *adapters.values())):
                raise ValueError("lora_adapters must map names to keys (strings)")
            return cls(str(data["endpoint"]), data.get("replay_endpoint"),
                       str(data.get("topic", "")), int(data["block_size"]),
                       str(data["hash_algo"]), str(data["model"]),
                       None if template is None else str(template), dict(adapters))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed kv_events_info: {exc}") from exc

    def hashing(self) -> tuple[str, int, str]:
        """What must be equal for two instances' block hashes to name the same prefixes."""
        return self.model, self.block_size, self.hash_algo


@dataclass
class Instance:
    url: str
    # This instance's nibble in the KV index (1, 2, ...; 0 is shared stores).
    slot: int
    role: Role = "instance"
    healthy: bool = False
    # Requests the router has sent there and not seen finish.
    in_flight: int = 0
    # Requests the instance itself reports running or waiting (all clients, not only ours).
    reported_load: int = 0
    # Prompt tokens still to compute (tier-weighted, as the policy estimated them) of the
    # requests the router sent there whose first token has not come back: prefill work a new
    # request would wait behind.
    queued_tokens: int = 0
    num_health_failures: int = 0
    events: EventsInfo | None = None
    # Whether its events feed the index (they do once subscribed; not if it hashes differently).
    indexed: bool = False
    # time.monotonic() of the last event batch received from it.
    last_event_at: float | None = None
    # time.monotonic() of the first request finished there since its last event batch: it
    # should have published by now; None when it has.
    awaiting_events_since: float | None = None
    # A decode instance's transfer engine address (its GET /v1/kv_transfer_info), where a
    # prefill instance sends the prompt's KV; None: it computes prompts itself.
    transport_address: str | None = None
    # time.monotonic() when the info it failed to give (events, transfer address) is read
    # again, and the back-off that led there; None: nothing to read again.
    info_retry_at: float | None = None
    info_backoff_s: float = 0.0

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_load)
