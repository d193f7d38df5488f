"""ModelRunner: runs one scheduled step on the model over the paged KV cache and samples."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from kvtier.connector.base import TRANSFER_POLL_S, KVConnectorOutput, KVConnectorWorker
from kvtier.kv import KVCacheConfig
from kvtier.lora.layers import LoRABatch
from kvtier.models import cpu_kernels
from kvtier.sched.output import ModelRunnerOutput, SchedulerOutput
from kvtier.worker.draft_check import check_drafts
from kvtier.worker.input_batch import BatchInputs, InputBatchBuilder
from kvtier.worker.kv_cache import allocate_kv_caches
from kvtier.worker.logprobs import prompt_logprobs
from kvtier.worker.request_state import RequestState, RequestStates
from kvtier.worker.sampler import Sampler, SamplingRow


class ModelRunner:
    """Holds the model, the KV cache tensors (allocated once) and per-request state.

    `execute_model` is the whole worker side of one engine step, connector hooks included.
    """

    def __init__(self, model: nn.Module, kv_cache_config: KVCacheConfig, *,
                 dtype: torch.dtype, device: torch.device, max_num_seqs: int,
                 kv_cache_dtype: torch.dtype | None = None,
                 max_num_batched_tokens: int, max_model_len: int, seed: int,
                 eos_token_ids: Sequence[int],
                 connector: KVConnectorWorker | None = None,
                 lora: LoRABatch | None = None) -> None:
        self.model = model
        # With LoRA: where each step says which rows run which adapter (kvtier/lora).
        self.lora = lora
        self.device = device
        self.connector = connector
        self.eos_token_ids = tuple(eos_token_ids)
        layer_names = model.config.layer_names
        self.kv_caches = allocate_kv_caches(kv_cache_config, layer_names=layer_names,
                                            dtype=dtype, device=device,
                                            kv_dtype=kv_cache_dtype)
        if connector is not None:
            connector.register_kv_caches(dict(zip(layer_names, self.kv_caches)))
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.states = RequestStates(device)
        self.inputs = InputBatchBuilder(
            num_groups=len(kv_cache_config.kv_cache_groups), block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_tokens=max_num_batched_tokens,
            max_blocks_per_seq=-(-max_model_len // block_size), device=device)
        self.sampler = Sampler(device, seed)
        if device.type == "cpu":
            cpu_kernels.ops()  # build (first run on a machine) now rather than in the first step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.states.apply(scheduler_output)
        if self.connector is None:
            return self._forward_and_sample(scheduler_output, self._prepare(scheduler_output))
        return self._execute_with_connector(scheduler_output)

    def wait_for_kv_transfers(self, timeout_s: float) -> None:
        """After a step with nothing to compute: wait at most `timeout_s` for the connector's
        transfers, whose end the next step collects."""
        if self.connector is None:
            time.sleep(min(timeout_s, TRANSFER_POLL_S))
        else:
            self.connector.wait_for_transfers(timeout_s)

    def interrupt_kv_wait(self) -> None:
        """End `wait_for_kv_transfers` at once; safe from any thread."""
        if self.connector is not None:
            self.connector.interrupt_wait()

    def _prepare(self, scheduler_output: SchedulerOutput) -> BatchInputs | None:
        if scheduler_output.is_empty:
            return None
        scheduled = [(self.states[req_id], n)
                     for req_id, n in scheduler_output.num_scheduled_tokens.items()]
        return self.inputs.build(scheduled, self.connector,
                                 scheduler_output.scheduled_spec_decode_tokens)

    def _execute_with_connector(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The worker half's hook sequence around the forward pass."""
        connector = self.connector
        if scheduler_output.kv_connector_metadata is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        try:
            batch = self._prepare(scheduler_output)
            connector.start_load_kv(batch.metadata if batch is not None else None)
            output = self._forward_and_sample(scheduler_output, batch)
            connector.wait_for_save()
            sending, recving = connector.get_finished(set(scheduler_output.finished_req_ids))
            output.kv_connector_output = KVConnectorOutput(
                finished_sending=set(sending), finished_recving=set(recving),
                invalid_block_ids=set(connector.get_block_ids_with_load_errors()),
                stats=dict(connector.get_stats()), events=list(connector.take_events()),
                connector_report=connector.build_connector_report())
        finally:
            connector.clear_connector_metadata()
        return output

    def _forward_and_sample(self, scheduler_output: SchedulerOutput,
                            batch: BatchInputs | None) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if batch is None:
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids={})
        hidden = self._forward(req_ids, batch)  # (T, hidden)
        output = ModelRunnerOutput(req_ids=req_ids,
                                   sampled_token_ids={req_id: [] for req_id in req_ids})
        self._compute_prompt_logprobs(scheduler_output, batch, hidden)
        if batch.sampling:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # (S, vocab) fp32
            result = self.sampler.sample(logits, [self._sampling_row(s) for s in batch.sampling])
            made = self._verify_drafts(batch, hidden, result.token_ids)
            for row, (state, token, token_logprobs) in enumerate(zip(
                    batch.sampling, result.token_ids, result.logprobs)):
                if token is None:
                    output.errors[state.req_id] = result.errors[row]
                    continue
                if state.grammar is not None and not state.grammar.accept(token):
                    output.errors[state.req_id] = state.grammar.why_refused(token)
                    continue
                tokens = made.get(row, [token])
                state.token_ids.extend(tokens)
                output.sampled_token_ids[state.req_id] = tokens
                if token_logprobs is not None:
                    output.logprobs[state.req_id] = [token_logprobs]
                if state.prompt_logprobs is not None:
                    # The first prompt token has nothing before it to predict it.
                    output.prompt_logprobs[state.req_id] = [None, *state.prompt_logprobs]
                    state.prompt_logprobs = None
        return output

    def _forward(self, req_ids: list[str], batch: BatchInputs) -> torch.Tensor:
        if self.lora is None:
            return self.model.forward(batch.input_ids, batch.positions, self.kv_caches,
                                      batch.metadata)
        self.lora.begin_step([self.states[r].lora for r in req_ids],
                             batch.metadata.query_start_loc_list)
        try:
            return self.model.forward(batch.input_ids, batch.positions, self.kv_caches,
                                      batch.metadata)
        finally:
            self.lora.end_step()

    def _verify_drafts(self, batch: BatchInputs, hidden: torch.Tensor,
                       sampled: list[int | None]) -> dict[int, list[int]]:
        """Row of `batch.sampling` -> the tokens its drafts leave it this step (the drafts the
        model agrees with, then its own token); only rows that computed drafts."""
        if not batch.drafts:
            return {}
        logits = self.model.compute_logits(hidden[batch.draft_logits_indices])  # (D, V)
        rows = [row for row, _ in batch.drafts]
        # A row whose sampling failed has no bonus: its drafts are checked, then dropped.
        made = check_drafts(self.sampler, logits, [
            (self._sampling_row(batch.sampling[row]), drafts, sampled[row] or 0)
            for row, drafts in batch.drafts])
        return {row: tokens for row, tokens in zip(rows, made) if sampled[row] is not None}

    def _compute_prompt_logprobs(self, scheduler_output: SchedulerOutput, batch: BatchInputs,
                                 hidden: torch.Tensor) -> None:
        """For the requests that ask: the logprobs of the prompt tokens this step's hidden
        states predict (position p predicts token p + 1). Such a request reads no cache, so
        its prompt is computed from position 0, in order, chunk by chunk."""
        starts = batch.metadata.query_start_loc_list
        for row, (req_id, num_new) in enumerate(scheduler_output.num_scheduled_tokens.items()):
            state = self.states[req_id]
            if state.prompt_logprobs is None:
                continue
            first = state.num_computed_tokens  # == len(state.prompt_logprobs) until the end
            end = min(first + num_new, state.num_prompt_tokens - 1)
            if end <= first:
                continue
            rows = hidden[starts[row]:starts[row] + end - first]  # (P, hidden)
            next_ids = torch.tensor(state.token_ids[first + 1:end + 1], device=hidden.device)
            state.prompt_logprobs.extend(prompt_logprobs(
                self.model.compute_logits, rows, next_ids, state.params.prompt_logprobs))

    def _sampling_row(self, state: RequestState) -> SamplingRow:
        params = state.params
        eos = () if params.ignore_eos else self.eos_token_ids
        if params.repetition_penalty != 1.0 and state.prompt_tensor is None:
            state.prompt_tensor = torch.tensor(state.token_ids[:state.num_prompt_tokens],
                                               dtype=torch.long, device=self.device)
        if params.allowed_token_ids and state.allowed_ids is None:
            state.allowed_ids = torch.tensor(params.allowed_token_ids, dtype=torch.long,
                                             device=self.device)
        return SamplingRow(params, self.states.generators.get(state.req_id),
                           eos + tuple(params.stop_token_ids), state.token_ids,
                           state.num_prompt_tokens, state.prompt_tensor,
                           state.bad_words_token_ids, state.grammar, state.allowed_ids)

    def shutdown(self) -> KVConnectorOutput | None:
        """Stop the connector's worker half; returns its last report, on the transfers that
        ended while it stopped, for the scheduler half (None without a connector)."""
        if self.connector is None:
            return None
        self.connector.shutdown()
        return KVConnectorOutput(connector_report=self.connector.build_connector_report())
