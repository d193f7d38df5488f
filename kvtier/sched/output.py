"""Plain data passed between the scheduler, the model runner and the engine each step.

One engine step:
    scheduler_output = scheduler.schedule()
    runner_output    = runner.execute_model(scheduler_output)
    core_outputs     = scheduler.update_from_output(scheduler_output, runner_output)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.connector.base import KVConnectorMetadata, KVConnectorOutput
    from kvtier.logprobs import PromptLogprobs, SampleLogprobs
    from kvtier.lora.adapter import LoRAAdapter
    from kvtier.sampling_params import SamplingParams
    from kvtier.structured_output import StructuredOutputGrammar


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption."""

    req_id: str
    # Prompt plus every output token so far (a resumed request recomputes its outputs' KV).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # One list of block ids per KV cache group.
    block_ids: tuple[list[int], ...]
    # Tokens whose KV is already in the paged cache (local prefix hit or external load).
    num_computed_tokens: int
    # Token id sequences the sampler must never complete (SamplingParams.bad_words).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The request's structured output grammar (Request.grammar), already past its outputs.
    grammar: StructuredOutputGrammar | None = None
    # The LoRA adapter it runs with (Request.lora).
    lora: LoRAAdapter | None = None


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds; only what changed since its last step."""

    req_id: str
    # Blocks appended to the request's block table in each group (empty lists if none).
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step (0 is never listed).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were preempted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # req_id -> the draft tokens the step computes after its last token (counted in
    # num_scheduled_tokens); only requests that speculate are listed.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> tokens a connector loads synchronously into the blocks of a request admitted
    # this step (counted in its num_computed_tokens, not in num_scheduled_tokens); only
    # requests with such a load are listed.
    num_external_computed_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    # Order of requests in this step's batch.
    req_ids: list[str]
    # req_id -> tokens sampled this step: one token for a request whose whole known sequence has
    # now been computed, [] for a prefill chunk that did not reach the end of the prompt.
    sampled_token_ids: dict[str, list[int]]
    # req_id -> per sampled token, the top-k and the sampled token (only when asked for).
    logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    # req_id -> the whole prompt's logprobs, with the request's first sampled token (only when
    # asked for).
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # req_id -> why its step failed (e.g. sampling); the scheduler finishes it with an error.
    errors: dict[str, str] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class EngineCoreOutput:
    """What the engine's output processor needs for one request after one step."""

    req_id: str
    new_token_ids: list[int]
    # "stop" | "length" | "abort" | "error" once finished, else None.
    finish_reason: str | None = None
    # The stop token id that ended the request, if one did.
    stop_reason: int | str | None = None
    new_logprobs: SampleLogprobs = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
