"""Prompt token ids from a request's text or messages: the one path every endpoint takes.

Generation (``/v1/completions``, ``/v1/chat/completions``) and tokenization (``/tokenize``,
the ``/render`` endpoints) call these same two functions with the same request fields, so
the ids a router learns from tokenization are exactly the ids the engine caches, and
the ``token_ids`` of its KV events hash to what the router computes.

* A text prompt is encoded with ``add_special_tokens`` (default on, as in vLLM's
  completions: the tokenizer's post-processor may add a BOS).
* Messages are rendered with the model's chat template, then encoded with
  ``add_special_tokens`` (default off, as in vLLM's chat: the template already wrote any
  BOS it wants). ``add_generation_prompt`` opens the assistant's turn;
  ``continue_final_message`` instead leaves the last message open so the model continues
  it (the rendered text is cut right after that message's content). The two exclude each
  other.
* ``chat_template_kwargs`` are extra template variables; they may not replace the ones the
  server sets. A per-request ``chat_template`` is refused: rendering untrusted Jinja can
  take unbounded memory, and vLLM refuses it too unless the operator opts in.

Every problem is an ``APIError`` (400) naming the field, never a 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefixcache.entrypoints.openai.errors import bad_request

# Variables the server passes to every chat template; a request may not override them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token"})


def encode_text_prompt(tokenizer: Any, text: str, *, add_special_tokens: bool = True,
                       param: str = "prompt") -> list[int]:
    """Token ids of one text prompt; 400 when nothing is left after tokenization."""
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not token_ids:
        raise bad_request("prompt is empty after tokenization", param=param)
    return list(token_ids)


def render_chat_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template (see the module
    docstring for each option); 400 for anything the request must change."""
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                          "true", param="continue_final_message")
    if chat_template is not None:
        raise bad_request("this server does not accept a per-request chat_template; the "
                          "model's own template is used", param="chat_template")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(extra))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}",
                          param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
    except Exception as exc:  # noqa: BLE001 - template errors come from the request's data
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc
    if continue_final_message:
        text = _cut_after_final_message(text, messages)
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not token_ids:
        raise bad_request("messages render to an empty prompt", param="messages")
    return list(token_ids)


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` up to the end of the last message's content, so the turn stays open."""
    final_content = messages[-1].get("content") or ""
    if not final_content:
        raise bad_request("continue_final_message needs a last message with content",
                          param="continue_final_message")
    end = text.rfind(final_content)
    if end < 0:
        raise bad_request("continue_final_message: the chat template changes the last "
                          "message's content, so it cannot be continued",
                          param="continue_final_message")
    return text[:end + len(final_content)]
