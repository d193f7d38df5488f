"""Tokenizers from HF directories and from GGUF metadata; the SmolLM2 GGUF's tokenizer equals
transformers' reading of the same file."""

import json
import os

import pytest

from kvtier.models import ChatTemplateError, ModelLoadError, Tokenizer, default_model_path
from kvtier.models.gguf_tokenizer import tokenizer_from_gguf

from .gguf_writer import MERGES, tokens

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _tiny_backend():
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens(),
              "tokenizer.ggml.merges": MERGES, "tokenizer.ggml.token_type": [3, 3] + [1] * 260}
    return tokenizer_from_gguf(fields, "fields").backend


def write_hf_tokenizer(directory, config: dict) -> None:
    _tiny_backend().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_directory_tokenizer_with_config_template(tmp_path):
    write_hf_tokenizer(tmp_path, {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
                                   "chat_template": TEMPLATE})
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path), extra_eos_token_ids=(7, 1))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (0, (1, 7))
    ids = tokenizer.encode("hello")
    assert ids == [tokens().index("hello")]
    assert tokenizer.decode([0] + ids + [1]) == "hello"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == "[system] be brief\n[user] hi\n"


def test_chat_template_file_wins_over_config(tmp_path):
    write_hf_tokenizer(tmp_path, {"chat_template": "config"})
    (tmp_path / "chat_template.jinja").write_text("file {{ messages[0]['content'] }}")
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "file x"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    write_hf_tokenizer(tmp_path, {})
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_raise_exception_is_a_chat_template_error(tmp_path):
    template = "{{ raise_exception('roles must alternate') }}"
    write_hf_tokenizer(tmp_path, {"chat_template": template})
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tokenizer.apply_chat_template([])


def test_directory_without_tokenizer_json_has_none(tmp_path):
    assert Tokenizer.from_hf_dir(str(tmp_path)) is None


@pytest.mark.slow  # opening the 49k-token vocabulary twice takes ~30 s on a shared CPU
def test_smollm2_gguf_tokenizer_equals_transformers():
    from transformers import AutoTokenizer

    from kvtier.models.gguf_file import GGUFModelFile

    path = default_model_path()
    ours = tokenizer_from_gguf(GGUFModelFile(path).fields, path)
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                           gguf_file=os.path.basename(path))
    texts = ["The capital of France is", "Hello, world! 12345 numbers",
             "héllo 世界 🙂  spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>",
             "don't  I'll x=1+2"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("key,value,problem", [
    ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model 'llama' is not supported"),
    ("tokenizer.ggml.pre", "mystery", "tokenizer.ggml.pre 'mystery' is not supported"),
])
def test_unsupported_gguf_tokenizer_names_the_file(key, value, problem):
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens(),
              "tokenizer.ggml.merges": MERGES, key: value}
    with pytest.raises(ModelLoadError, match=f"^m.gguf: {problem}"):
        tokenizer_from_gguf(fields, "m.gguf")


def test_special_tokens_map_names_what_the_config_lacks(tmp_path):
    """Older checkpoints name bos/eos (and unk, pad...) only in special_tokens_map.json, which
    transformers reads; before, kvtier's templates lost BOS and EOS was unknown."""
    from transformers import AutoTokenizer

    template = "{{ bos_token }}[{{ pad_token }}]{{ messages[0]['content'] }}{{ eos_token }}"
    write_hf_tokenizer(tmp_path, {"chat_template": template,
                                   "tokenizer_class": "PreTrainedTokenizerFast"})
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
         "pad_token": "</s>", "additional_special_tokens": ["<s>"]}))
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.bos_token_id, ours.eos_token_ids) == (theirs.bos_token_id,
                                                       (theirs.eos_token_id,)) == (0, (1,))
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False) == "<s>[</s>]hello</s>"


def test_tokenizer_config_wins_over_special_tokens_map(tmp_path):
    write_hf_tokenizer(tmp_path, {"bos_token": "</s>", "eos_token": None})
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, (1,))
