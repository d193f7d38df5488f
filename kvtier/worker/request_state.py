"""What the model runner remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.logprobs import Logprob
from kvtier.lora.adapter import LoRAAdapter
from kvtier.sampling_params import SamplingParams
from kvtier.sched.output import SchedulerOutput
from kvtier.structured_output import StructuredOutputGrammar


@dataclass
class RequestState:
    req_id: str
    # Prompt plus every token sampled so far; the runner appends what it samples.
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    # Block ids per KV cache group, append-only while the request runs.
    block_ids: list[list[int]]
    num_computed_tokens: int
    # The prompt's token ids as a tensor, made at the first step that needs them (a repetition
    # penalty looks at them every step).
    prompt_tensor: torch.Tensor | None = None
    # With prompt_logprobs asked for: those of prompt tokens 1.. computed so far, until they
    # go out with the request's first sampled token (then None).
    prompt_logprobs: list[dict[int, Logprob]] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    grammar: StructuredOutputGrammar | None = None
    lora: LoRAAdapter | None = None
    # SamplingParams.allowed_token_ids as a tensor, made at the request's first sampled step.
    allowed_ids: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class RequestStates:
    """Per-request state kept in step with the scheduler's view (SchedulerOutput)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states: dict[str, RequestState] = {}
        # Kept across preemption (only dropped at finish), so a seeded request draws the same
        # sequence whether or not it was preempted on the way.
        self.generators: dict[str, torch.Generator] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
            self.generators.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.states[new.req_id] = RequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                [list(ids) for ids in new.block_ids], new.num_computed_tokens,
                prompt_logprobs=None if new.sampling_params.prompt_logprobs is None else [],
                bad_words_token_ids=new.bad_words_token_ids, grammar=new.grammar,
                lora=new.lora)
            seed = new.sampling_params.seed
            if seed is not None and new.req_id not in self.generators:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
                self.generators[new.req_id] = generator
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            for group_ids, new_ids in zip(state.block_ids, cached.new_block_ids):
                group_ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def __getitem__(self, req_id: str) -> RequestState:
        return self.states[req_id]

    def __len__(self) -> int:
        return len(self.states)
