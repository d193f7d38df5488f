"""The scheduler's view of one generation request: tokens, status and prefix-cache identity."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash
    from kvtier.sampling_params import SamplingParams
    from kvtier.structured_output import StructuredOutputGrammar


class LoRAIdentity(Protocol):
    """What the KV cache reads of a LoRA adapter (kvtier.lora.adapter.LoRAAdapter; a router's
    copy from an instance's kv_events_info): its name, for events, and its content digest, which
    block hashes carry."""

    @property
    def name(self) -> str: ...

    @property
    def cache_key(self) -> str: ...


class RequestStatus(enum.IntEnum):
    """Lifecycle states; every value after PREEMPTED is a finished state."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class MultiModalFeature:
    """One multimodal item (image, audio clip) whose placeholder tokens sit in the prompt.

    `identifier` names the item's content (e.g. a hash of its bytes); two prompts with the same
    tokens but different images must not share KV, so the identifier joins the block hash.
    """

    identifier: str
    offset: int  # first placeholder token position in the prompt
    length: int  # number of placeholder tokens

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"MultiModalFeature.offset must be >= 0, got {self.offset}")
        if self.length <= 0:
            raise ValueError(f"MultiModalFeature.length must be > 0, got {self.length}")


class Request:
    """Token state of one request as the scheduler and the KV cache manager see it.

    `block_hashes` holds the chained hash of every full block of `all_token_ids`; it grows as
    output tokens are appended, so blocks filled during decode become prefix-cacheable too.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora: LoRAIdentity | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        skip_reading_prefix_cache: bool = False,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
        grammar: StructuredOutputGrammar | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        eos_token_id: int | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # The adapter it runs with (the engine's loaded one); lora_name defaults to its name.
        self.lora = lora
        self.lora_name = lora.name if lora_name is None and lora is not None else lora_name
        self.mm_features: list[MultiModalFeature] = mm_features or []
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        # The token ids of SamplingParams.bad_words (the engine's tokenizer made them).
        self.bad_words_token_ids = bad_words_token_ids
        # SamplingParams.structured_outputs compiled; the runner advances it token by token,
        # and it stays with the request through preemption.
        self.grammar = grammar
        self.kv_transfer_params = kv_transfer_params
        self.eos_token_id = eos_token_id

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_preemptions = 0
        # num_preemptions when its prefix-cache lookup was last counted in the stats: a request
        # asked again while it waits (a connector retry, no free blocks) counts once per start.
        self.prefix_lookup_counted: int | None = None
        # Tokens served from any cache (local or external) when first scheduled; None until then.
        self.num_cached_tokens: int | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None

        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by every output token. Read-only by convention: append via
        `append_output_token_ids` so the block hashes stay in step."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        """Output-token cap from the sampling params; None means up to the model's context."""
        return None if self.sampling_params is None else self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Lets a priority heap order requests by (priority, arrival_time) with a stable tiebreak.
        return ((self.priority, self.arrival_time, self.request_id)
                < (other.priority, other.arrival_time, other.request_id))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})")
