"""Engine: the step loop. schedule -> execute -> update_from_output -> outputs -> metrics.

Runs in the caller's thread (LLM) or in one engine thread (AsyncLLM); not thread-safe itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from kvtier.common.malloc_tuning import keep_step_buffers_in_heap
from kvtier.common.token_ids import all_ints, first_outside
from kvtier.config import EngineConfig
from kvtier.connector.base import ConnectorContext, KVConnectorScheduler, KVConnectorWorker
from kvtier.engine.errors import EngineQueueFullError
from kvtier.engine.metrics import MetricsRegistry
from kvtier.engine.output_processor import ChildState, OutputProcessor, ParentState
from kvtier.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvtier.engine.runtime import (
    build_connectors,
    derive_runtime,
    resolve_device,
    resolve_dtype,
)
from kvtier.engine.stats import EngineStats
from kvtier.kv import KVCacheManager, Request, RequestStatus
from kvtier.lora import LoRAError, LoRARequest
from kvtier.lora.adapter import LoRAAdapter
from kvtier.lora.registry import LoRARegistry
from kvtier.models.detokenizer import IncrementalDetokenizer
from kvtier.models.generation_config import load_eos_token_ids
from kvtier.models.loader import load_model
from kvtier.sampling_params import SamplingParams
from kvtier.sched.config import SchedulerConfig
from kvtier.sched.errors import SchedulerQueueFullError
from kvtier.sched.scheduler import Scheduler
from kvtier.structured_output import GrammarCompiler, StructuredOutputGrammar
from kvtier.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long a step with nothing to compute waits at most before returning (see Engine.step): the
# connector ends the wait sooner when a transfer may have ended (most poll every 0.5 ms) or on
# `interrupt_idle_wait`; the next step also expires late transfers.
IDLE_STEP_WAIT_S = 0.05


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = resolve_device(config.model.device)
        if device.type == "cpu":
            keep_step_buffers_in_heap()
        loaded = load_model(config.model.model, dtype=resolve_dtype(config.model.dtype),
                            device=device)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.runtime = derive_runtime(config, loaded.config, device,
                                      resolve_dtype(config.model.dtype))
        self.metrics = MetricsRegistry()
        self.stats = EngineStats(self.metrics, self.runtime.max_model_len)
        self.stats.describe_cache(
            block_size=config.cache.block_size,
            num_gpu_blocks=self.runtime.kv_cache_config.num_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            cache_dtype=self.runtime.kv_identity.dtype)
        self._eos_token_ids = self._find_eos_token_ids()
        self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                         self._eos_token_ids)
        self.loras: LoRARegistry | None = None
        if config.lora.enable_lora:
            self.loras = LoRARegistry(loaded.model, max_lora_rank=config.lora.max_lora_rank,
                                      dtype=self.runtime.dtype, device=device,
                                      max_cpu_loras=config.lora.max_cpu_loras)
            self.stats.describe_loras(config.lora.max_loras)
        self._outputs = OutputProcessor(self.tokenizer)
        self._stopped = False
        self._build_core(loaded.model)

    def _build_core(self, model: Any) -> None:
        """The connector, and the KV cache manager, scheduler and model runner around it. A
        failure after the connector is built stops it before it propagates: its tiers hold
        files and ports (a disk tier's locked file, a p2p listener) that a corrected engine in
        this process would otherwise find taken."""
        config, runtime = self.config, self.runtime
        context = ConnectorContext(block_size=config.cache.block_size,
                                   num_layers=self.model_config.num_layers,
                                   kv_identity=runtime.kv_identity, metrics=self.metrics,
                                   kv_cache_config=runtime.kv_cache_config,
                                   kv_events=config.cache.enable_kv_cache_events,
                                   max_model_len=runtime.max_model_len,
                                   hash_algo=config.cache.hash_algo)
        scheduler_connector, worker_connector = build_connectors(config.kv_transfer_config,
                                                                 context)
        try:
            self._build_around(model, scheduler_connector, worker_connector)
        except BaseException:
            _stop_connectors(scheduler_connector, worker_connector)
            raise

    def _build_around(self, model: Any, scheduler_connector: KVConnectorScheduler | None,
                      worker_connector: KVConnectorWorker | None) -> None:
        config, runtime = self.config, self.runtime
        transfer = config.kv_transfer_config
        self.kv_cache_manager = KVCacheManager(
            runtime.kv_cache_config, runtime.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
            hash_algo=config.cache.hash_algo,
            enable_kv_cache_events=config.cache.enable_kv_cache_events,
            watermark=config.cache.watermark)
        sched = config.scheduler
        load_options = {} if transfer is None else {
            "kv_load_timeout_s": transfer.kv_load_timeout_s,
            "kv_load_failure_policy": transfer.kv_load_failure_policy}
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            max_model_len=runtime.max_model_len,
            enable_chunked_prefill=sched.enable_chunked_prefill, policy=sched.policy,
            max_waiting_requests=sched.max_waiting_requests,
            speculative=self._speculative_config(),
            max_loras=config.lora.max_loras if self.loras is not None else None, **load_options)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager, scheduler_connector)
        self.runner = ModelRunner(
            model, runtime.kv_cache_config, dtype=runtime.dtype, device=runtime.device,
            max_num_seqs=sched.max_num_seqs, kv_cache_dtype=runtime.kv_cache_dtype,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=runtime.max_model_len, seed=config.model.seed,
            eos_token_ids=self._eos_token_ids, connector=worker_connector,
            lora=self.loras.batch if self.loras is not None else None)
        # The manager's hash block size and algorithm, so request hashes match its lookups.
        self._block_hasher = self.kv_cache_manager.make_block_hasher()

    def _speculative_config(self) -> Any:
        """config.speculative_config, for a model it can run on."""
        speculative = self.config.speculative_config
        if speculative is not None and self.model_config.conv_layer_indices:
            # A rejected draft would have advanced the convolutions' recurrent state.
            raise ValueError(f"speculative_config: {self.model_config.name} has short "
                             "convolution layers, whose state drafts would advance; "
                             "speculative decoding needs an attention-only model")
        return speculative

    def _find_eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's (else config.json's) EOS ids first, then generation_config.json's."""
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            eos = tuple(self.tokenizer.eos_token_ids)
        else:
            eos = tuple(self.model_config.eos_token_ids)
        extra = load_eos_token_ids(self.config.model.model)
        bad = first_outside(list(extra), self.model_config.vocab_size)
        if bad is not None:
            raise ValueError(f"generation_config.json of {self.config.model.model}: "
                             f"eos_token_id {bad} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        return eos + tuple(dict.fromkeys(i for i in extra if i not in eos))

    @property
    def model_name(self) -> str:
        return self.model_config.name

    @property
    def max_model_len(self) -> int:
        return self.runtime.max_model_len

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None,
                    kv_transfer_params: dict[str, Any] | None = None,
                    arrival_time: float | None = None,
                    grammar: StructuredOutputGrammar | None = None,
                    lora_request: LoRARequest | None = None,
                    lora_adapter: LoRAAdapter | None = None) -> None:
        """Queue a request. ValueError for a bad prompt or a duplicate id; EngineQueueFullError
        when the waiting queue is full. `grammar`: params.structured_outputs compiled already
        (compile_grammar, off the engine thread); compiled here if not given. `lora_request`:
        its adapter, loaded here unless `lora_adapter` is that adapter loaded already
        (load_lora, off the engine thread)."""
        if self._outputs.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError(f"priority {priority} needs the priority scheduling policy "
                             "(--scheduling-policy priority); this engine serves in arrival "
                             "order")
        self._check_params(params)
        lora = lora_adapter
        if lora is None and lora_request is not None:
            lora = self.load_lora(lora_request)
        prompt_text, token_ids = self._tokenize(prompt)
        if grammar is None:
            grammar = self.compile_grammar(params)
        arrival = time.time() if arrival_time is None else arrival_time
        children = self._make_children(request_id, params, token_ids, grammar,
                                       priority=priority, cache_salt=cache_salt,
                                       arrival_time=arrival, lora=lora,
                                       kv_transfer_params=kv_transfer_params)
        added: list[str] = []
        try:
            for request in children:
                self.scheduler.add_request(request)
                added.append(request.request_id)
        except Exception as exc:
            # All of the request's completions or none (a child's id taken, a full queue).
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            if isinstance(exc, SchedulerQueueFullError):
                raise EngineQueueFullError(str(exc)) from exc
            raise
        self._outputs.add(self._make_parent(request_id, prompt_text, token_ids, params,
                                            children, arrival))

    def compile_grammar(self, params: SamplingParams) -> StructuredOutputGrammar | None:
        """params.structured_outputs compiled for this model (None without one); GrammarError
        (a ValueError) if it is invalid. Thread safe: callers compile off the engine thread,
        since a large schema takes a while."""
        if params.structured_outputs is None:
            return None
        return self._grammars.compile(params.structured_outputs)

    def load_lora(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter `request` names, loaded (and kept) if it is not yet; LoRAError (a
        ValueError) when LoRA is off or the adapter cannot be used. Thread safe."""
        if self.loras is None:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} asked for, but this engine "
                            "runs without LoRA: start it with enable_lora=True (--enable-lora)")
        return self.loras.load(request)

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: its token ids against this vocabulary (an
        id past it would fail the whole batched sampling step)."""
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = first_outside(ids, vocab)
            if bad is not None:
                raise ValueError(f"SamplingParams.{name} holds token id {bad}, outside the "
                                 f"vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"SamplingParams.{name} must be <= the vocabulary size "
                                 f"{vocab} (or -1 for all of it), got {value}")

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            token_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            token_ids, text = list(prompt), None
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, longer than the model's "
                             f"context length max_model_len={self.max_model_len}")
        vocab = self.model_config.vocab_size
        if not all_ints(token_ids) or first_outside(token_ids, vocab) is not None:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        return text, token_ids

    def _make_children(self, request_id: str, params: SamplingParams, token_ids: list[int],
                       grammar: StructuredOutputGrammar | None, **options: Any) -> list[Request]:
        """n > 1: n scheduler requests on one prompt (prefix caching shares its blocks)."""
        eos = self._eos_token_ids
        # The scheduler knows one EOS id per request; a model's other EOS ids stop it too.
        extra_eos = [] if params.ignore_eos else list(eos[1:])
        bad_words = self._bad_words_token_ids(params.bad_words)
        children = []
        for index in range(params.n):
            child_params = dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index,
                stop_token_ids=list(params.stop_token_ids) + extra_eos)
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            # Prompt logprobs come from computing the whole prompt: no cached prefix is read.
            children.append(Request(child_id, list(token_ids), child_params,
                                    eos_token_id=eos[0] if eos else None,
                                    block_hasher=self._block_hasher,
                                    skip_reading_prefix_cache=params.prompt_logprobs is not None,
                                    bad_words_token_ids=bad_words,
                                    grammar=grammar if index == 0 or grammar is None
                                    else grammar.copy(), **options))
        return children

    def _bad_words_token_ids(self, bad_words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as vLLM takes them: the word alone, and with a leading space
        where that is another first token of as many tokens (a word inside the text)."""
        if bad_words and self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this model has none")
        result: list[tuple[int, ...]] = []
        for word in bad_words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not alone:
                raise ValueError(f"SamplingParams.bad_words entry {word!r} makes no token")
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            result.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                result.append(spaced)
        return tuple(result)

    def _make_parent(self, request_id: str, prompt: str | None, token_ids: list[int],
                     params: SamplingParams, children: list[Request],
                     arrival: float) -> ParentState:
        states = []
        for index, child in enumerate(children):
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                    prompt_token_ids=token_ids)
            completion = CompletionOutput(index, "", [], logprobs=(
                [] if params.logprobs is not None else None))
            states.append(ChildState(child.request_id, index, child.sampling_params,
                                     detokenizer, completion))
        return ParentState(request_id, prompt, token_ids, states, RequestMetrics(arrival))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests and free their blocks; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = [child for rid in ids for child in self._outputs.child_ids(rid)]
        if child_ids:
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            # No step may follow (nothing left to run): refresh the gauges now.
            self.stats.record_scheduler(self.scheduler.make_stats())
        for rid in ids:
            self._outputs.remove(rid)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests with new tokens or finished in it."""
        started = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self.runner.execute_model(scheduler_output)
            core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        except BaseException:
            # The step's requests fail (the caller aborts them); the KV they were to write
            # must not outlive them in the prefix cache.
            self.scheduler.failures.uncache_failed_step(scheduler_output)
            raise
        processed = self._outputs.process(core_outputs)
        if processed.stopped_req_ids:
            self.scheduler.finish_requests(processed.stopped_req_ids,
                                           RequestStatus.FINISHED_STOPPED)
        if processed.failed_req_ids:
            self.scheduler.finish_requests(processed.failed_req_ids,
                                           RequestStatus.FINISHED_ERROR)
        self.stats.record_scheduler(self.scheduler.make_stats())
        seconds = None if scheduler_output.is_empty else time.monotonic() - started
        self.stats.record_step(processed, sum(len(c.new_token_ids) for c in core_outputs),
                               seconds)
        if scheduler_output.is_empty:
            # Nothing to compute: every live request waits on a KV transfer. Waiting hands the
            # cores and the GIL to the transfer threads instead of spinning on them; the wait
            # ends early when the connector sees a transfer end or a command comes.
            self.runner.wait_for_kv_transfers(IDLE_STEP_WAIT_S)
        return processed.outputs

    def interrupt_idle_wait(self) -> None:
        """End an idle step's wait for transfers at once (a new command is queued for the
        engine thread); safe from any thread."""
        self.runner.interrupt_kv_wait()

    def has_unfinished_requests(self) -> bool:
        """Also True while finished requests' blocks wait on a connector transfer: stepping
        lets the worker report it."""
        return (self.scheduler.has_unfinished_requests()
                or self.scheduler.has_pending_kv_transfers())

    def get_metrics(self) -> dict[str, float]:
        return self.metrics.snapshot()

    def take_kv_events(self) -> list[Any]:
        return list(self.scheduler.take_kv_events())

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_invariants(self) -> None:
        """AssertionError if the KV cache bookkeeping is inconsistent (tests call it)."""
        self.kv_cache_manager.check_invariants()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def shutdown(self) -> None:
        """Stop, keeping what this instance computed: the connector's worker half finishes its
        copies and hands its last report to the scheduler half, which flushes it to the
        connector's stores, then both stop. Each of those waits has its own deadline. Later
        calls do nothing."""
        if self._stopped:
            return
        self._stopped = True
        self.scheduler.shutdown(self.runner.shutdown())


def _stop_connectors(scheduler_connector: KVConnectorScheduler | None,
                     worker_connector: KVConnectorWorker | None) -> None:
    """Stop both halves of a connector the engine failed to start around, the worker's first
    as at shutdown; a half that fails to stop is logged, never hides why the start failed."""
    for half in (worker_connector, scheduler_connector):
        if half is None:
            continue
        try:
            half.shutdown()
        except Exception:
            logger.exception("stopping the %s of a connector after a failed start",
                             type(half).__name__)
