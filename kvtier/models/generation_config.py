"""A model's generation_config.json as sampling defaults, vLLM's way (--generation-config).

Hugging Face model directories may ship one; the fields below, where it sets them, become what
a request that leaves them unset samples with (the OpenAI server's requests, `LLM.generate`
without sampling parameters). Its `eos_token_id` (one id or a list) adds to the ids that end a
completion, whatever --generation-config says, as in vLLM: chat models often list their
end-of-turn token there only. Other fields (max_new_tokens, do_sample, ...) are not taken.
"""

from __future__ import annotations

import json
import os

from kvtier.models.errors import ModelLoadError
from kvtier.sampling_params import SamplingParams

GENERATION_CONFIG = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(source: str, model_path: str | None) -> dict[str, float]:
    """The sampling defaults a request that leaves those fields unset gets, vLLM's way
    (--generation-config): "auto" reads the model directory's generation_config.json (a
    model without one, a GGUF file, gives none), "vllm" takes none, and any other value is a
    directory holding a generation_config.json. Only SAMPLING_FIELDS are taken; ValueError
    names a file that is not JSON or whose values are not numbers in SamplingParams' ranges."""
    if source == "vllm":
        return {}
    if source == "auto":
        if model_path is None or not os.path.isdir(model_path):
            return {}
        path = os.path.join(model_path, GENERATION_CONFIG)
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(source, GENERATION_CONFIG)
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config {source}: no {GENERATION_CONFIG} there; give "
                             "a directory that holds one, 'auto' (the model's) or 'vllm' (none)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from exc
    defaults = {}
    for name in SAMPLING_FIELDS:
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
        defaults[name] = value
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return defaults


def load_eos_token_ids(model_path: str | None) -> tuple[int, ...]:
    """The `eos_token_id` ids of the model directory's generation_config.json (none without
    one); ModelLoadError names a file whose value is not an id or a list of ids."""
    if model_path is None or not os.path.isdir(model_path):
        return ()
    path = os.path.join(model_path, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return ()
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from exc
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(path, f"eos_token_id must be a token id or a list of them "
                                   f"(integers >= 0), got {value!r}; write the ids the "
                                   "tokenizer gives the tokens, not their text")
    return tuple(ids)
