"""Which safetensors files a directory load reads, and what load_weights refuses: a piece of a
fused parameter given twice or never, non-float tensors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.models import ModelLoadError, load_model
from kvtier.models.safetensors_weights import INDEX_FILE, safetensors_files

from .helpers import PagedDriver, hf_logits, make_covering_hf_model

_V_PROJ = "model.layers.0.self_attn.v_proj.weight"
_Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def model_dir(tmp_path):
    """(HF model, its directory, its tensors), the directory holding model.safetensors."""
    hf_model = make_covering_hf_model("mistral", tmp_path)
    return hf_model, tmp_path, load_file(tmp_path / "model.safetensors")


def _shard(directory, tensors: dict[str, torch.Tensor], write_index: bool = True) -> None:
    """Replace model.safetensors by two shards (and their index, if asked)."""
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file_name, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, directory / file_name)
    if write_index:
        weight_map = {n: f for f, shard_names in shards.items() for n in shard_names}
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _mistral_native(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # A few of Mistral's own names, as its consolidated.safetensors spells them.
    return {name.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq")
            .replace("model.embed_tokens", "tok_embeddings"): t for name, t in tensors.items()}


def test_index_picks_the_shards_beside_mistral_consolidated_file(model_dir):
    hf_model, directory, tensors = model_dir
    _shard(directory, tensors)
    save_file(_mistral_native(tensors), directory / "consolidated.safetensors")
    (directory / "stale-copy.safetensors").write_bytes(b"not read: the index does not name it")
    assert [p.rsplit("/", 1)[1] for p in safetensors_files(str(directory))] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    loaded = load_model(str(directory), dtype=torch.float32)
    prompt = [5, 9, 40, 3, 77, 100, 12]
    torch.testing.assert_close(PagedDriver(loaded.model).step({0: prompt})[0],
                               hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


def test_without_index_consolidated_files_are_skipped(model_dir):
    _, directory, tensors = model_dir
    _shard(directory, tensors, write_index=False)
    save_file(_mistral_native(tensors), directory / "consolidated.safetensors")
    load_model(str(directory), dtype=torch.float32)


def test_index_naming_a_missing_shard_names_it(model_dir):
    _, directory, tensors = model_dir
    _shard(directory, tensors)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json: names the weight "
                                             r"file 'model-00002-of-00002\.safetensors', which "
                                             r"is not in the directory"):
        load_model(str(directory))


def test_a_tensor_in_two_files_is_refused(model_dir):
    _, directory, tensors = model_dir
    save_file({_Q_PROJ: tensors[_Q_PROJ]}, directory / "zz-extra.safetensors")
    with pytest.raises(ModelLoadError, match=f"tensor '{_Q_PROJ}' appears more than once"):
        load_model(str(directory))


def test_a_duplicated_piece_does_not_cover_a_missing_one(model_dir):
    _, directory, tensors = model_dir
    weights = [(n, t) for n, t in tensors.items() if n != _V_PROJ] + [(_Q_PROJ, tensors[_Q_PROJ])]
    model = load_model(str(directory), dtype=torch.float32).model
    with pytest.raises(ModelLoadError, match=f"src: tensor '{_Q_PROJ}' appears more than once"):
        model.load_weights(weights, "src")


def test_a_missing_piece_of_a_fused_parameter_is_named(model_dir):
    _, directory, tensors = model_dir
    save_file({n: t for n, t in tensors.items() if n != _V_PROJ},
              directory / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"missing tensors: {_V_PROJ}$"):
        load_model(str(directory))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.float8_e4m3fn])
def test_non_float_tensors_are_refused(model_dir, dtype):
    _, directory, tensors = model_dir
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({**tensors, name: tensors[name].to(dtype)}, directory / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}' has dtype {dtype}; kvtier loads "
                                             r"only fp32/fp16/bf16 weights"):
        load_model(str(directory))


def test_fp16_tensors_still_load(model_dir):
    _, directory, tensors = model_dir
    save_file({n: t.half() for n, t in tensors.items()}, directory / "model.safetensors")
    load_model(str(directory), dtype=torch.float32)
