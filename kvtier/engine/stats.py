"""The engine's own Prometheus series, with vLLM's names, fed once per step."""

from __future__ import annotations

import time

from kvtier.engine.metrics import MetricsRegistry
from kvtier.engine.output_processor import ProcessedStep
from kvtier.sched.stats import SchedulerStats

# Seconds; vLLM's TTFT and latency bucket edges.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Seconds; vLLM's inter-token latency edges (also per-request time per output token).
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def token_count_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to the context length, for per-request token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# Seconds; engine steps. A running request gets at most one token a step, so its time between
# tokens is the step's, the prefill chunks scheduled beside it included.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineStats:
    def __init__(self, metrics: MetricsRegistry, max_model_len: int) -> None:
        self._metrics = metrics
        self.running = metrics.gauge("vllm:num_requests_running",
                                     "Requests in model execution batches.")
        self.waiting = metrics.gauge("vllm:num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = metrics.gauge("vllm:kv_cache_usage_perc",
                                      "Fraction of device KV cache blocks in use (0-1).")
        self.prefix_queries = metrics.counter("vllm:prefix_cache_queries",
                                              "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = metrics.counter("vllm:prefix_cache_hits",
                                           "Prompt tokens found in the prefix cache.")
        self.preemptions = metrics.counter("vllm:num_preemptions",
                                           "Requests preempted to free KV cache blocks.")
        self.prompt_tokens = metrics.counter("vllm:prompt_tokens",
                                             "Prompt tokens of requests that produced output.")
        self.generation_tokens = metrics.counter("vllm:generation_tokens", "Generated tokens.")
        self.ttft = metrics.histogram("vllm:time_to_first_token_seconds",
                                      "Time from arrival to the first generated token.",
                                      buckets=TTFT_BUCKETS)
        self.e2e = metrics.histogram("vllm:e2e_request_latency_seconds",
                                     "Time from arrival to the end of the request.",
                                     buckets=LATENCY_BUCKETS)
        self.success = metrics.counter("vllm:request_success", "Finished requests by reason.",
                                       labelnames=("finished_reason",))
        self.inter_token = metrics.histogram(
            "vllm:inter_token_latency_seconds", "Time between a completion's successive tokens.",
            buckets=INTER_TOKEN_BUCKETS)
        self.time_per_output_token = metrics.histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per finished completion: time from its first to its last token, per token after "
            "the first.", buckets=INTER_TOKEN_BUCKETS)
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = metrics.histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
            buckets=token_buckets)
        self.request_generation_tokens = metrics.histogram(
            "vllm:request_generation_tokens", "Generated tokens of each finished completion.",
            buckets=token_buckets)
        self.kv_load_failures = metrics.counter(
            "kvtier:kv_load_failures", "Connector KV loads that failed or missed their deadline.")
        self.lookup_timeouts = metrics.counter(
            "kvtier:connector_lookup_timeouts",
            "Requests admitted without the connector after it answered 'not yet' past "
            "kv_load_timeout_s.")
        self.spec_drafts = metrics.counter(
            "vllm:spec_decode_num_drafts", "Speculative decoding: drafts computed.")
        self.spec_draft_tokens = metrics.counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens computed.")
        self.spec_accepted_tokens = metrics.counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens the model agreed with (kept).")
        self.step_seconds = metrics.histogram(
            "kvtier:engine_step_seconds",
            "Duration of engine steps that computed tokens (schedule, forward, sampling, "
            "bookkeeping): a decoding request waits one step for each token.",
            buckets=STEP_BUCKETS)
        # Set by describe_loras when the engine serves LoRA adapters.
        self._lora_info = None
        self._lora_labels: tuple[str, str, str] | None = None

    def describe_cache(self, **config: object) -> None:
        """vLLM's vllm:cache_config_info: 1, the device cache's settings as labels (gateways
        read block_size and num_gpu_blocks from it)."""
        info = self._metrics.gauge("vllm:cache_config_info", "The device KV cache's configuration.",
                                   labelnames=tuple(config))
        info.labels(**{name: str(value) for name, value in config.items()}).set(1)

    def describe_loras(self, max_loras: int) -> None:
        """vLLM's vllm:lora_requests_info: one series whose labels name the adapters running
        and waiting, valued at the time it was last set."""
        self._lora_info = self._metrics.gauge(
            "vllm:lora_requests_info", "LoRA adapters of running and waiting requests.",
            labelnames=("max_lora", "waiting_lora_adapters", "running_lora_adapters"))
        self._max_loras = str(max_loras)

    def _record_loras(self, stats: SchedulerStats) -> None:
        labels = (self._max_loras, ",".join(stats.waiting_loras), ",".join(stats.running_loras))
        if labels != self._lora_labels:
            self._lora_info.clear()  # one series: the adapters now, not every set seen
            self._lora_labels = labels
        self._lora_info.labels(*labels).set(time.time())

    def record_scheduler(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.preemptions.inc(stats.num_preemptions)
        self.kv_load_failures.inc(stats.num_kv_load_failures + stats.num_kv_load_timeouts)
        self.lookup_timeouts.inc(stats.num_connector_lookup_timeouts)
        self.spec_drafts.inc(stats.num_spec_drafts)
        self.spec_draft_tokens.inc(stats.num_spec_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_spec_accepted_tokens)
        if self._lora_info is not None and stats.running_loras is not None:
            self._record_loras(stats)

    def record_step(self, step: ProcessedStep, num_new_tokens: int,
                    seconds: float | None) -> None:
        """`seconds`: how long the step took; None for a step that computed nothing."""
        self.generation_tokens.inc(num_new_tokens)
        if seconds is not None:
            self.step_seconds.observe(seconds)
        for parent in step.first_tokens:
            self.prompt_tokens.inc(len(parent.prompt_token_ids))
            self.ttft.observe(parent.metrics.first_token_time - parent.metrics.arrival_time)
        for interval in step.token_intervals:
            self.inter_token.observe(interval)
        for parent in step.finished:
            self.e2e.observe(parent.metrics.finished_time - parent.metrics.arrival_time)
            self.request_prompt_tokens.observe(len(parent.prompt_token_ids))
            for child in parent.children:
                self.success.labels(finished_reason=child.completion.finish_reason).inc()
                num_tokens = len(child.completion.token_ids)
                self.request_generation_tokens.observe(num_tokens)
                if num_tokens > 1 and child.first_token_time is not None:
                    self.time_per_output_token.observe(
                        (child.last_token_time - child.first_token_time) / (num_tokens - 1))
