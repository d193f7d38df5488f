"""Chat templates render here exactly as transformers' `apply_chat_template(tokenize=False)`
renders them from the same tokenizer directory: its Jinja tags, filters, globals and variables."""

import os

import jinja2
import pytest

from kvtier.models import ChatTemplateError, Tokenizer

from .test_tokenizer import write_hf_tokenizer

SMOLLM2_HF = "/opt/kvtier-peer/smollm2-hf"

CONFIG = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>",
          "unk_token": "hello", "pad_token": "</s>", "image_token": "<s>",
          "extra_special_tokens": {"audio_token": "</s>"}, "add_bos_token": False}

MESSAGES = [{"role": "system", "content": "Sé <b>breve</b> & 'claro' 中文"},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]

FEATURES = {
    "break": "{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}"
             "{{ m.content }};{% endfor %}",
    "continue": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{{ m.content }};{% endfor %}",
    "generation": "{% set x = 'out' %}{% for m in messages %}{% generation %}{% set x = 'in' %}"
                  "[{{ m.content }}]{% endgeneration %}{% endfor %}{{ x }}",
    "tojson": "{{ messages[0].content | tojson }} {{ {'z': 1, 'a': [2]} | tojson }}",
    "tojson_options": "{{ messages[1] | tojson(indent=2, sort_keys=true) }}",
    "tools_absent": "{% if tools is not none %}[TOOLS]{% endif %}{% if tools is defined %}"
                    "[DEFINED]{% endif %}{% if documents is none %}[NO DOCS]{% endif %}",
    "strftime_now": "{{ strftime_now('%Y-%m') }}",
    "special_tokens": "[{{ bos_token }}][{{ eos_token }}][{{ unk_token }}][{{ pad_token }}]"
                      "[{{ image_token }}][{{ audio_token }}][{{ sep_token is defined }}]",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                 "{% endfor %}{{ ns.n }} {{ dict(a=1) }}",
    "whitespace": "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n"
                  "    {% endif %}\n{% endfor %}",
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(ours, transformers') read from one small tokenizer directory."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    write_hf_tokenizer(directory, CONFIG)
    return Tokenizer.from_hf_dir(str(directory)), AutoTokenizer.from_pretrained(str(directory))


def _render_both(tokenizers, template: str, **kwargs) -> tuple[str, str]:
    ours, theirs = tokenizers
    ours.set_chat_template(template)
    return (ours.apply_chat_template(MESSAGES, **kwargs),
            theirs.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                       add_generation_prompt=True, **kwargs))


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature_renders_as_in_transformers(tokenizers, name):
    ours, theirs = _render_both(tokenizers, FEATURES[name])
    assert ours == theirs


def test_expected_renderings(tokenizers):
    rendered = {name: _render_both(tokenizers, FEATURES[name])[0]
                for name in ("break", "generation", "tojson", "tools_absent", "special_tokens")}
    assert rendered == {
        "break": "Sé <b>breve</b> & 'claro' 中文;Hi;",
        "generation": "[Sé <b>breve</b> & 'claro' 中文][Hi][Hello!][Bye]out",
        "tojson": '"Sé <b>breve</b> & \'claro\' 中文" {"z": 1, "a": [2]}',
        "tools_absent": "[DEFINED][NO DOCS]",
        "special_tokens": "[<s>][</s>][hello][</s>][<s>][</s>][False]",
    }


def test_tools_passed_as_a_variable(tokenizers):
    tools = [{"type": "function", "function": {"name": "now", "description": "the time <UTC>"}}]
    template = "{% if tools is not none %}{% for t in tools %}{{ t | tojson }}{% endfor %}" \
               "{% endif %}"
    ours, theirs = _render_both(tokenizers, template, tools=tools)
    assert ours == theirs == '{"type": "function", "function": {"name": "now", ' \
                             '"description": "the time <UTC>"}}'


def test_raise_exception_is_an_error_with_its_message(tokenizers):
    ours, theirs = tokenizers
    template = "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}" \
               "{% endif %}"
    with pytest.raises(jinja2.TemplateError, match="^no system role$"):
        theirs.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)
    ours.set_chat_template(template)
    with pytest.raises(ChatTemplateError, match="failed to render: no system role$"):
        ours.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("template,problem", [
    ("{% frobnicate %}", "does not parse: .*unknown tag 'frobnicate'"),
    ("{{ messages.__class__.__mro__ }}", "failed to render: .*unsafe"),
    ("{{ messages.append(1) }}", "failed to render: .*unsafe"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "failed to render: .*'_x'"),
    ("{% set ns = namespace(_x=1) %}", "failed to render: .*'_x'"),
])
def test_template_problems_are_clear_errors_and_the_sandbox_holds(tokenizers, template,
                                                                  problem):
    with pytest.raises(ChatTemplateError, match=problem):
        tokenizers[0].set_chat_template(template)
        tokenizers[0].apply_chat_template(MESSAGES)


@pytest.mark.skipif(not os.path.isdir(SMOLLM2_HF), reason="no SmolLM2 HF directory here")
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_renders_as_in_transformers(add_generation_prompt):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_hf_dir(SMOLLM2_HF)
    theirs = AutoTokenizer.from_pretrained(SMOLLM2_HF)
    for messages in (MESSAGES[1:3], MESSAGES[:3], MESSAGES):
        assert ours.apply_chat_template(messages, add_generation_prompt) == \
            theirs.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
