"""LLM: the offline API in vLLM's shape, running the engine loop in the caller's thread."""

from __future__ import annotations

import atexit
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from kvtier.common.sizes import parse_size
from kvtier.config import EngineConfig
from kvtier.connector.config import KVTransferConfig
from kvtier.engine.engine import Engine
from kvtier.engine.outputs import RequestOutput
from kvtier.lora import LoRARequest
from kvtier.models.chat import render_chat
from kvtier.models.generation_config import load_sampling_defaults
from kvtier.sampling_params import SamplingParams

# A text prompt, or {"prompt_token_ids": [...]} (optionally with "prompt" for display), or
# {"prompt": text}; either dict may carry a "cache_salt".
PromptType = str | dict[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
Messages = list[dict[str, Any]]
# Engines of LLMs (or kept from them: `LLM(...).engine`) not shut down when the interpreter
# exits are shut down then, so write-back tiers write their chunks out.
_RUNNING: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shut_down_running_engines() -> None:
    for engine in list(_RUNNING):
        engine.shutdown()


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", block_size: int = 16,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 128, kv_cache_memory_bytes: int | str | None = None,
                 num_device_blocks: int | None = None,
                 kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None,
                 kv_offload: str | None = None, seed: int = 0, device: str | None = None,
                 **engine_options: Any) -> None:
        """`engine_options`: any other EngineConfig field by name (max_model_len,
        enable_chunked_prefill, policy, hash_algo, watermark, ...). Every option is checked
        before the model loads: a bad one raises ValueError naming it."""
        if kv_cache_memory_bytes is not None:
            kv_cache_memory_bytes = parse_size(kv_cache_memory_bytes, "kv_cache_memory_bytes")
        config = EngineConfig.create(
            model=model, dtype=dtype, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_memory_bytes, num_device_blocks=num_device_blocks,
            kv_transfer_config=kv_transfer_config, kv_offload=kv_offload, seed=seed,
            device=device, **engine_options)
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        _RUNNING.add(self.engine)
        self._ids = itertools.count()
        # What generate() samples with when given no parameters: SamplingParams' defaults, less
        # what the model's generation_config.json sets (as vLLM's LLM does).
        self._sampling_defaults = load_sampling_defaults("auto", config.model.model)

    def shutdown(self) -> None:
        """Stop the engine, keeping what it computed (write-back tiers write out what they
        hold; a restart on the same disk tier finds it); the LLM serves no more. Also at
        the end of a `with LLM(...) as llm:` block, and at exit for an engine still running."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self._sampling_defaults)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`, each finished. `lora_request`: the LoRA adapter
        of every prompt, or one per prompt (None: the base model); loaded on first use."""
        if self.engine.stopped:
            raise RuntimeError("this LLM was shut down; make a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), LoRARequest, "lora_request")
        request_ids: list[str] = []
        try:
            for prompt, prompt_params, lora in zip(prompts, params, loras):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, _prompt_input(prompt), prompt_params,
                                        cache_salt=_cache_salt(prompt), lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            # All or nothing: the prompts already queued would otherwise run, unseen, in the
            # next call.
            self.engine.abort_request(request_ids)
            raise
        outputs = self._run(request_ids, use_tqdm)
        for output, prompt in zip(outputs, prompts):
            if output.prompt is None and isinstance(prompt, dict):
                output.prompt = prompt.get("prompt")  # the text shown for given token ids
        return outputs

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts, content a string or OpenAI's
        text parts) or a list of them; the options as in the server's chat requests (`tools`:
        OpenAI's function tools, for the chat template)."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.engine.tokenizer, conversation,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template_kwargs=chat_template_kwargs, tools=tools)
                   for conversation in conversations]
        # The template already wrote the special tokens (BOS) it wants.
        token_prompts = [{"prompt": p, "prompt_token_ids": self.engine.tokenizer.encode(
            p, add_special_tokens=False)} for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(request_ids), desc="Processed prompts")
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            # A step that raised (or an interrupt) must not leave this call's requests queued:
            # the next call would step them, or wait on them, forever.
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]

    def get_metrics(self) -> dict[str, float]:
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False while requests still hold blocks."""
        return self.engine.reset_prefix_cache()


def _per_prompt(value: Any, count: int, kind: type, name: str) -> list[Any]:
    """`value` (one `kind`, or None) for every prompt, or its one-per-prompt sequence."""
    if value is None or isinstance(value, kind):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"got {len(value)} {name} for {count} prompts; give one, or one per "
                         "prompt")
    return list(value)


def _prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS)) if isinstance(prompt, dict) else []
    if unknown:
        raise ValueError(f"a prompt dict takes the keys {', '.join(_PROMPT_KEYS)}; "
                         f"{', '.join(map(repr, unknown))} is not supported")
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', "
                     f"got {prompt!r}")


def _cache_salt(prompt: PromptType) -> str | None:
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"a prompt's cache_salt must be a string, got {salt!r}")
    return salt
