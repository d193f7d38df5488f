"""What every endpoint needs: the AsyncLLM, the served names, limits and server metrics."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.engine.async_llm import AsyncLLM
from kvtier.entrypoints.openai.errors import NotFoundError
from kvtier.entrypoints.openai.responses.store import DEFAULT_STORE_BYTES, ResponseStore
from kvtier.lora import LoRARequest

T = TypeVar("T")
# Prompts of more characters than this are tokenized on a worker thread: a long one would stall
# the event loop (every stream, /health) for seconds; a short one costs less than the hop.
INLINE_PROMPT_CHARS = 16_384
# Threads that tokenize long prompts; more would only take cores from the engine.
NUM_TOKENIZE_THREADS = 2

# vLLM's bucket edges for request parameters.
_N_BUCKETS = (1, 2, 5, 10, 20)
_MAX_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                       50000, 100000)


class ServerMetrics:
    """Series the HTTP layer measures; the engine records the per-request ones itself."""

    def __init__(self, registry: Any) -> None:
        self.http_requests = registry.counter(
            "http_requests_total", "HTTP requests by handler, method and status class.",
            labelnames=("handler", "method", "status"))
        self.params_n = registry.histogram("vllm:request_params_n",
                                           "The n request parameter.", buckets=_N_BUCKETS)
        self.params_max_tokens = registry.histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.",
            buckets=_MAX_TOKENS_BUCKETS)

    def observe_params(self, n: int, max_tokens: int | None) -> None:
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)


@dataclass
class ServerContext:
    async_llm: AsyncLLM
    # The first name is the one responses carry; requests may use any of them.
    served_model_names: tuple[str, ...]
    model_path: str | None
    api_key: str | None
    metrics: ServerMetrics
    # Report usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details).
    enable_prompt_tokens_details: bool = False
    # How chat answers under tool_choice "auto" write tool calls (--tool-call-parser); None:
    # "auto" is refused.
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is told from its answer (--reasoning-parser).
    reasoning_parser: str | None = None
    # With one: the ids of its <think> and </think> tokens.
    thinking_token_ids: tuple[int, int] | None = None
    # What a request that leaves a sampling field unset gets (--generation-config).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # What GET /v1/kv_events_info answers: where KV events are published and how blocks are
    # hashed; None: the server publishes none.
    kv_events_info: dict[str, Any] | None = None
    # LoRA adapters clients may name as their `model` (--lora-modules, loaded at run time, or
    # found in --lora-resolver-dir).
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    # An adapter's base model name where --lora-modules gave one (else the served model's).
    lora_parents: dict[str, str] = field(default_factory=dict)
    # A directory of adapters, one per subdirectory: a `model` naming one that is not known
    # yet becomes known, and loads with its first request.
    lora_resolver_dir: str | None = None
    # Responses kept for previous_response_id and GET /v1/responses/{id}.
    response_store: ResponseStore = field(
        default_factory=lambda: ResponseStore(DEFAULT_STORE_BYTES))
    # The tokenizer is safe to share with these threads: encoding and decoding never change it.
    tokenize_executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        NUM_TOKENIZE_THREADS, thread_name_prefix="kvtier-tokenize"))

    @property
    def engine(self) -> Any:
        return self.async_llm.engine

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    async def prepare(self, num_chars: int, build: Callable[..., T], *args: Any) -> T:
        """`build(*args)` (prompt rendering and tokenization) for a request with `num_chars`
        characters of text: inline when short, else on a tokenizer thread."""
        if num_chars <= INLINE_PROMPT_CHARS:
            return build(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_executor, build,
                                                                *args)

    def check_model(self, requested: str | None) -> None:
        """None means the served model (vLLM allows leaving it out); a LoRA adapter's name is
        a model too."""
        if requested is not None and requested not in self.served_model_names \
                and requested not in self.lora_modules and not self._resolve_lora(requested):
            served = ", ".join([*self.served_model_names, *self.lora_modules])
            raise NotFoundError(f"the model '{requested}' does not exist; this server serves "
                                f"{served}", param="model", code="model_not_found")

    def _resolve_lora(self, name: str) -> bool:
        """Whether --lora-resolver-dir has an adapter directory called `name` (one path
        component, not hidden); it then joins the known adapters."""
        if self.lora_resolver_dir is None or not name or name.startswith(".") \
                or any(c in name for c in "/\\\0"):
            return False
        path = os.path.join(self.lora_resolver_dir, name)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return False
        self.lora_modules.setdefault(name, self.new_lora_request(name, path))
        return True

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names, None for the base model; NotFoundError for
        an adapter unloaded since the request's model was checked. With its path: an adapter
        the engine dropped to make room (--max-cpu-loras) loads again."""
        if requested is None or requested in self.served_model_names:
            return None
        if requested not in self.lora_modules:
            self.check_model(requested)  # raises, unless the resolver directory has it again
        return self.lora_modules[requested]

    def new_lora_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with the next unused lora_int_id."""
        next_id = max((r.lora_int_id for r in self.lora_modules.values()), default=0) + 1
        return LoRARequest(name, next_id, path)

    def response_model(self, requested: str | None) -> str:
        """The served name a response carries: the one the request used (checked), else the
        first."""
        return requested or self.model_name
