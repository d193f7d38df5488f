"""A GGUF written the way llama.cpp writes it loads into the same model as its HF source."""

import os

import pytest
import torch

from kvtier.models import IncrementalDetokenizer, ModelLoadError, load_model
from kvtier.models.gguf_file import GGUFModelFile
from kvtier.models.gguf_tokenizer import tokenizer_from_gguf

from .gguf_writer import CHAT_TEMPLATE, EOT_TOKEN_ID, tokens, write_gguf
from .helpers import PagedDriver, hf_logits, make_covering_hf_model


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf")
    hf_model = make_covering_hf_model("llama", directory, vocab_size=len(tokens()),
                                      attention_bias=False)
    path = str(directory / "tiny.gguf")
    write_gguf(hf_model, path)
    return hf_model, path


def test_gguf_config_matches_the_hf_config(gguf_pair):
    _, path = gguf_pair
    config = load_model(path, dtype=torch.float32).config
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads,
            config.num_kv_heads, config.head_dim, config.vocab_size) == ("llama", 2, 64, 4, 2, 16,
                                                                          262)
    assert (config.tie_word_embeddings, config.bos_token_id, config.eos_token_ids) == (
        False, 0, (1, EOT_TOKEN_ID))
    assert config.name == path


def test_gguf_logits_match_hf(gguf_pair):
    hf_model, path = gguf_pair
    loaded = load_model(path, dtype=torch.float32)
    prompt = [5, 70, 33, 200, 261, 9, 9, 100, 4, 150, 3]
    driver = PagedDriver(loaded.model)
    torch.testing.assert_close(driver.step({0: prompt})[0], hf_logits(hf_model, prompt),
                               atol=1e-4, rtol=0)
    # One decode step over the cache written by the prefill.
    torch.testing.assert_close(driver.step({0: [17]})[0][-1],
                               hf_logits(hf_model, prompt + [17])[-1], atol=1e-4, rtol=0)


def test_gguf_tokenizer_from_metadata(gguf_pair):
    _, path = gguf_pair
    tokenizer = load_model(path, dtype=torch.float32).tokenizer
    vocab = {t: i for i, t in enumerate(tokens())}
    # add_bos_token puts <s> first; "hello" is fully merged; " world" is one byte per token.
    expected = [0, vocab["hello"]] + [vocab[c] for c in "Ġworld"]
    assert tokenizer.encode("hello world") == expected
    assert tokenizer.encode("hello world", add_special_tokens=False) == expected[1:]
    assert tokenizer.decode(expected) == "hello world"
    assert tokenizer.decode(expected, skip_special_tokens=False) == "<s>hello world"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.vocab_size) == (
        0, (1, EOT_TOKEN_ID), 262)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|user|>hi<|assistant|>")


def test_incremental_detokenizer_holds_back_split_characters(gguf_pair):
    _, path = gguf_pair
    tokenizer = load_model(path, dtype=torch.float32).tokenizer
    text = "hello é世"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Byte-level alphabet only: "é" is 2 tokens, "世" is 3.
    assert len(ids) == 1 + 1 + 2 + 3
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.step([i]) for i in ids]
    assert deltas == ["hello", " ", "", "é", "", "", "世"]
    assert detokenizer.text == text
    assert detokenizer.flush() == ""


def test_incremental_detokenizer_flushes_a_broken_tail(gguf_pair):
    _, path = gguf_pair
    tokenizer = load_model(path, dtype=torch.float32).tokenizer
    first_byte_of_e_acute = tokenizer.encode("é", add_special_tokens=False)[0]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.step([tokenizer.encode("hello", add_special_tokens=False)[0]]) == "hello"
    assert detokenizer.step([first_byte_of_e_acute]) == ""
    assert detokenizer.flush() == "\ufffd"


@pytest.mark.parametrize("keep_bytes", [64, 4096, -16])
def test_truncated_gguf_names_the_file(gguf_pair, tmp_path, keep_bytes):
    _, path = gguf_pair
    with open(path, "rb") as f:
        data = f.read()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data[:keep_bytes])
    with pytest.raises(ModelLoadError, match=r"broken\.gguf: corrupt or truncated GGUF file"):
        load_model(str(broken))


def test_missing_gguf_file_names_it(tmp_path):
    missing = os.path.join(tmp_path, "absent.gguf")
    with pytest.raises(ModelLoadError, match=r"absent\.gguf: file not found"):
        load_model(missing)


def _tokenizer_fields(path: str, **changes) -> dict:
    """The GGUF's metadata with `changes` applied (a None value removes the key)."""
    fields = dict(GGUFModelFile(path).fields)
    for key, value in changes.items():
        key = f"tokenizer.ggml.{key}"
        fields.pop(key) if value is None else fields.__setitem__(key, value)
    return fields


def test_tokenizer_without_tokens_names_the_key(gguf_pair):
    _, path = gguf_pair
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: tokenizer\.ggml\.model is set but "
                                             r"tokenizer\.ggml\.tokens is missing"):
        tokenizer_from_gguf(_tokenizer_fields(path, tokens=None), path)


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id"])
def test_special_token_id_out_of_range_names_the_key(gguf_pair, key):
    _, path = gguf_pair
    with pytest.raises(ModelLoadError, match=rf"tiny\.gguf: tokenizer\.ggml\.{key} 99999 is out "
                                             r"of range for the 262 tokens"):
        tokenizer_from_gguf(_tokenizer_fields(path, **{key: 99999}), path)


def test_gguf_with_mlp_biases_matches_hf(tmp_path):
    """llama.cpp's llama graph adds ffn_{gate,up,down}.bias where the file has them; before,
    kvtier refused them as unexpected tensors."""
    hf_model = make_covering_hf_model("llama", tmp_path, vocab_size=len(tokens()),
                                      mlp_bias=True)
    path = str(tmp_path / "biased.gguf")
    write_gguf(hf_model, path)
    loaded = load_model(path, dtype=torch.float32)
    assert (loaded.config.attention_bias, loaded.config.o_proj_bias,
            loaded.config.mlp_bias) == (True, True, True)
    prompt = [5, 70, 33, 200, 261, 9, 9, 100, 4, 150, 3]
    torch.testing.assert_close(PagedDriver(loaded.model).step({0: prompt})[0],
                               hf_logits(hf_model, prompt), atol=1e-4, rtol=0)


SPECIALS_TEMPLATE = ("[{{ bos_token }}][{{ eos_token }}][{{ unk_token }}][{{ pad_token }}]"
                     "[{{ sep_token is defined }}][{{ mask_token is defined }}]")


def test_gguf_unk_and_pad_tokens_reach_chat_templates(gguf_pair):
    """Before, unk_token and pad_token were undefined in templates (an HF directory's
    tokenizer_config.json gives them)."""
    _, path = gguf_pair
    fields = _tokenizer_fields(path, unknown_token_id=1, padding_token_id=0,
                               seperator_token_id=99999)
    fields["tokenizer.chat_template"] = SPECIALS_TEMPLATE
    tokenizer = tokenizer_from_gguf(fields, path)
    # An out-of-range id is left out, as llama.cpp leaves it out.
    assert tokenizer.special_tokens == {"bos_token": "<s>", "eos_token": "</s>",
                                        "unk_token": "</s>", "pad_token": "<s>"}
    assert tokenizer.apply_chat_template([]) == "[<s>][</s>][</s>][<s>][False][False]"


@pytest.mark.parametrize("metadata, problem", [
    ({"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0},
     r"llama\.rope\.scaling\.type must be absent or 'none' \(plain RoPE\), got 'linear'"),
    ({"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0},
     r"llama\.rope\.scaling\.type must be absent or 'none' \(plain RoPE\), got 'yarn'"),
    ({"{arch}.rope.scaling.factor": 4.0},
     r"llama\.rope\.scaling\.factor 4\.0 without llama\.rope\.scaling\.type means linear"),
    ({"{arch}.rope.scale_linear": 2.0},
     r"llama\.rope\.scale_linear 2\.0 without llama\.rope\.scaling\.type means linear"),
], ids=["linear", "yarn", "factor_without_type", "old_scale_linear_key"])
def test_gguf_rope_scaling_is_refused(gguf_pair, tmp_path, metadata, problem):
    """llama.cpp scales RoPE by these keys; before, kvtier ignored them and ran plain RoPE."""
    hf_model, _ = gguf_pair
    path = str(tmp_path / "scaled.gguf")
    write_gguf(hf_model, path, metadata)
    with pytest.raises(ModelLoadError, match=r"scaled\.gguf: invalid value: " + problem):
        load_model(path, dtype=torch.float32)


@pytest.mark.parametrize("metadata", [{"{arch}.rope.scaling.type": "none",
                                       "{arch}.rope.scaling.factor": 4.0},
                                      {"{arch}.rope.scaling.factor": 1.0}],
                         ids=["type_none", "factor_1"])
def test_gguf_without_rope_scaling_still_matches_hf(gguf_pair, tmp_path, metadata):
    """Type "none" turns scaling off in llama.cpp whatever the factor; a factor of 1 is none."""
    hf_model, _ = gguf_pair
    path = str(tmp_path / "plain.gguf")
    write_gguf(hf_model, path, metadata)
    prompt = [5, 70, 33, 200, 261, 9, 9, 100, 4, 150, 3]
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.config.rope_scaling is None
    torch.testing.assert_close(PagedDriver(loaded.model).step({0: prompt})[0],
                               hf_logits(hf_model, prompt), atol=1e-4, rtol=0)
