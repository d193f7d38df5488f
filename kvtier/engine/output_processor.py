"""Turns the scheduler's per-step token outputs into RequestOutputs: incremental
detokenization, stop strings, and the n children of a request gathered into one output."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvtier.logprobs import Logprob, PromptLogprobs
from kvtier.sampling_params import SamplingParams
from kvtier.sched.output import EngineCoreOutput

logger = logging.getLogger(__name__)


@dataclass
class ChildState:
    """One of a request's n completions; its id is the scheduler's request id."""

    req_id: str
    index: int
    params: SamplingParams
    # None when the engine has no tokenizer (token-id prompts only): text stays "".
    detokenizer: Any
    completion: CompletionOutput
    # Full decoded text; completion.text is what may be shown (stop-string hold-back applied).
    text: str = ""
    # When its first and latest tokens arrived (time.time()), for the latency series.
    first_token_time: float | None = None
    last_token_time: float | None = None
    # The longest stop string's length, found once: every step of the request needs it.
    max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_stop_len = max(map(len, self.params.stop), default=0)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    # With prompt_logprobs asked for, once the first token arrives (from the first completion
    # to bring it: all n compute the same).
    prompt_logprobs: PromptLogprobs | None = None
    # Filled when the first token arrives: the engine records TTFT once per request.
    counted_first_token: bool = False

    @property
    def finished(self) -> bool:
        return all(child.completion.finished() for child in self.children)


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput]
    # Child request ids that hit a stop string: the engine finishes them in the scheduler.
    stopped_req_ids: list[str] = field(default_factory=list)
    # Child request ids ended by an error (theirs or a sibling's): the engine finishes them.
    failed_req_ids: list[str] = field(default_factory=list)
    # Parents that got their first token or finished this step (for metrics).
    first_tokens: list[ParentState] = field(default_factory=list)
    finished: list[ParentState] = field(default_factory=list)
    # Seconds between a completion's tokens, one value per step that brought it more.
    token_intervals: list[float] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any = None) -> None:
        # Names the tokens in logprobs (Logprob.decoded_token); None: they stay unnamed.
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, ParentState] = {}

    def add(self, parent: ParentState) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.child_to_parent[child.req_id] = parent

    def has(self, request_id: str) -> bool:
        return request_id in self.parents

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [] if parent is None else [child.req_id for child in parent.children]

    def remove(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for child in parent.children if parent is not None else ():
            self.child_to_parent.pop(child.req_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedStep:
        now = time.time()
        step = ProcessedStep(outputs=[])
        touched: dict[str, ParentState] = {}
        for core in core_outputs:
            parent = self.child_to_parent.get(core.req_id)
            if parent is None:
                continue  # aborted by the caller while the step ran
            child = parent.children[_child_index(parent, core.req_id)]
            if core.new_token_ids:
                if child.last_token_time is not None:
                    step.token_intervals.append(now - child.last_token_time)
                else:
                    child.first_token_time = now
                child.last_token_time = now
            try:
                if self._apply(parent, child, core):
                    step.stopped_req_ids.append(child.req_id)
            except Exception as exc:
                # One request's bad output (e.g. a detokenizer failure) ends that request only.
                logger.exception("processing the output of request %s failed", core.req_id)
                parent.error = f"output processing failed: {exc!r}"
            if parent.error is not None:
                step.failed_req_ids.extend(_fail_unfinished(parent))
            touched[parent.request_id] = parent
        for parent in touched.values():
            if not parent.counted_first_token and any(c.completion.token_ids
                                                      for c in parent.children):
                parent.counted_first_token = True
                parent.metrics.first_token_time = now
                step.first_tokens.append(parent)
            if parent.finished:
                parent.metrics.finished_time = now
                step.finished.append(parent)
                self.remove(parent.request_id)
            step.outputs.append(_to_request_output(parent))
        return step

    def _apply(self, parent: ParentState, child: ChildState, core: EngineCoreOutput) -> bool:
        """Adds the new tokens; True when a stop string finished the child."""
        completion = child.completion
        completion.token_ids.extend(core.new_token_ids)
        if completion.logprobs is not None:
            for entry in core.new_logprobs:
                self._name_tokens(entry)
            completion.logprobs.extend(core.new_logprobs)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                entry[token].logprob
                for token, entry in zip(core.new_token_ids, core.new_logprobs) if token in entry)
        if core.prompt_logprobs is not None and parent.prompt_logprobs is None:
            for entry in core.prompt_logprobs:
                self._name_tokens(entry)
            parent.prompt_logprobs = core.prompt_logprobs
        if core.num_cached_tokens:
            parent.num_cached_tokens = max(parent.num_cached_tokens, core.num_cached_tokens)
        if core.kv_transfer_params is not None:
            parent.kv_transfer_params = core.kv_transfer_params
        if core.error is not None:
            parent.error = core.error
        stopped_by_string = False
        if child.detokenizer is not None and core.new_token_ids:
            previous_len = len(child.text)
            new_ids = core.new_token_ids
            if core.finish_reason == "stop" and not child.params.include_stop_str_in_output:
                # Ended by a stop token (EOS or stop_token_ids): its text is no part of the
                # answer, as in vLLM; token_ids keep it.
                new_ids = new_ids[:-1]
            child.text += child.detokenizer.step(new_ids) if new_ids else ""
            if core.finish_reason is not None:
                child.text += child.detokenizer.flush()
            if core.finish_reason is None or core.finish_reason == "length":
                stopped_by_string = _check_stop_strings(child, previous_len)
        if not stopped_by_string and core.finish_reason is not None:
            completion.finish_reason = core.finish_reason
            completion.stop_reason = core.stop_reason
        completion.text = _visible_text(child)
        return stopped_by_string and core.finish_reason is None

    def _name_tokens(self, entry: dict[int, Logprob] | None) -> None:
        if self.tokenizer is None or entry is None:
            return
        for token_id, logprob in entry.items():
            logprob.decoded_token = self.tokenizer.decode([token_id],
                                                          skip_special_tokens=False)


def _child_index(parent: ParentState, req_id: str) -> int:
    for position, child in enumerate(parent.children):
        if child.req_id == req_id:
            return position
    raise KeyError(req_id)


def _fail_unfinished(parent: ParentState) -> list[str]:
    """An error ends every completion of its request; returns the ids of those still live."""
    failed = []
    for child in parent.children:
        if not child.completion.finished():
            child.completion.finish_reason = "error"
            failed.append(child.req_id)
    return failed


def _check_stop_strings(child: ChildState, previous_len: int) -> bool:
    params = child.params
    if not params.stop or len(child.completion.token_ids) < params.min_tokens:
        return False
    # Only a match that ends in the new text is new; it may start up to longest-1 chars earlier.
    search_from = max(0, previous_len - child.max_stop_len + 1)
    found: tuple[int, str] | None = None
    for stop in params.stop:
        at = child.text.find(stop, search_from)
        if at != -1 and (found is None or at < found[0]):
            found = (at, stop)
    if found is None:
        return False
    at, stop = found
    child.text = child.text[:at + len(stop) if params.include_stop_str_in_output else at]
    child.completion.finish_reason = "stop"
    child.completion.stop_reason = stop
    return True


def _visible_text(child: ChildState) -> str:
    """Hold back a possible stop string's beginning until it is decided, so streamed text is
    never taken back."""
    if child.completion.finished() or not child.params.stop:
        return child.text
    hold = child.max_stop_len - 1
    return child.text[:max(0, len(child.text) - hold)]


def _to_request_output(parent: ParentState) -> RequestOutput:
    outputs = [CompletionOutput(c.completion.index, c.completion.text,
                                list(c.completion.token_ids), c.completion.finish_reason,
                                c.completion.stop_reason,
                                None if c.completion.logprobs is None
                                else list(c.completion.logprobs),
                                c.completion.cumulative_logprob)
               for c in parent.children]
    return RequestOutput(
        request_id=parent.request_id, prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=parent.prompt_logprobs,
        outputs=outputs, finished=parent.finished,
        num_cached_tokens=parent.num_cached_tokens, kv_transfer_params=parent.kv_transfer_params,
        error=parent.error, metrics=RequestMetrics(parent.metrics.arrival_time,
                                                   parent.metrics.first_token_time,
                                                   parent.metrics.finished_time))
