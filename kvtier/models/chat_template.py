"""The Jinja environment chat templates run in: the one transformers' `apply_chat_template`
gives them, so that a model's template renders here as it does there.

Templates come from model directories and `--chat-template`, i.e. from strangers: they run in
Jinja's immutable sandbox, which keeps them from touching Python internals or changing the
messages they are given.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from kvtier.models.errors import ChatTemplateError


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body. transformers uses the tag to
    mark the assistant's tokens for training masks; serving only needs the text. The body is
    a call block, as there, so that a `set` inside stays inside."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: jinja2.runtime.Macro) -> str:
        return caller()


class _Namespace(Namespace):
    """`namespace()` refusing names that start with "_": the sandbox already hides such
    attributes from reads, and transformers refuses to store them, so a template doing so
    fails here as it fails there."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature: self may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.sandbox.SecurityError(
            f"a chat template may not store {name!r} on a namespace (no names starting with _)")


def _raise_exception(message: str) -> None:
    # A TemplateError, so that apply_chat_template reports it like any other render failure.
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own filter escapes <, >, & and ' as \u003c... and sorts keys: tool schemas
    # and message contents would reach the model unlike the text it was trained on.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates pass it by)
    # Local time, as transformers gives it (Llama 3.1/3.2 templates print today's date).
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    """`source` compiled in the chat-template environment; a syntax error (an unknown tag
    included) is raised as ChatTemplateError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from exc
