"""Render chat templates the way Hugging Face `transformers` does.

Same Jinja2 setup: an immutable sandbox, `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, a `raise_exception` global, a `tojson` filter that keeps non-ASCII
characters, a `strftime_now` global, and `{% generation %}` blocks rendered as plain content.
Variables passed: `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and any extra
keyword (e.g. `tools`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template called `raise_exception` (e.g. roles that do not alternate)."""


class _GenerationBlock(Extension):
    """Accepts `{% generation %} ... {% endgeneration %}` and renders its body unchanged
    (transformers uses the markers only to build assistant-token masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Parse a template once; raises `jinja2.TemplateSyntaxError` on malformed source."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (dicts with at least `role` and `content`) to the prompt text."""
    template = compile_chat_template(source)
    return template.render(
        messages=[dict(message) for message in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
        **extra,
    )
