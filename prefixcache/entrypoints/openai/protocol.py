"""The OpenAI wire format the server speaks: request bodies (validated) and responses.

Requests are validated strictly (``"5"`` is not an integer, ``true`` is not a number), so a
client bug surfaces as a 400 naming the field instead of a silent coercion. Unknown fields
are ignored, as OpenAI-compatible servers do, so newer clients keep working; known fields
this server cannot honour (``logprobs``, ``echo``, ``tools``, ...) are refused with a 400
when set to anything but their neutral value, rather than quietly ignored.

Every text the server uses (prompts, message contents, stop strings, the model name, the
cache salt) must be valid Unicode: a lone UTF-16 surrogate is a 400 naming the field (see
``unicode_text``).

Checks that need the model (prompt and ``max_tokens`` against the context and the KV pool)
live in ``serving``; everything that needs only the body lives here.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from prefixcache.entrypoints.openai.tenancy import validate_cache_salt
from prefixcache.entrypoints.openai.unicode_text import check_unicode

# Bounds that keep one request from asking for unbounded server work; a client needing
# more samples or stop strings can send more requests.
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_BATCH_PROMPTS = 64

NonNegativeInt = Annotated[int, Field(ge=0)]


class OpenAIModel(BaseModel):
    """Base of every request: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class GenerationRequest(OpenAIModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``.

    ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``cache_salt`` and ``return_token_ids``
    are vLLM extensions. ``return_token_ids`` adds the prompt's and the generated token ids
    to the response (see :class:`TokenIdsFields` for where they go).
    ``max_tokens`` None means the endpoint's default (see each endpoint).
    """

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    return_token_ids: bool | None = None
    user: str | None = None
    # Neutral values accepted, anything else refused (see the module docstring).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None

    @field_validator("model")
    @classmethod
    def _check_model(cls, model: str | None) -> str | None:
        # The name is echoed in a 404 when it is not served.
        return None if model is None else check_unicode(model, "the model name")

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        return None if salt is None else validate_cache_salt(salt)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        for index, text in enumerate(stops):
            check_unicode(text, "the stop string" if isinstance(stop, str)
                          else f"stop string {index}")
        return stop

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> GenerationRequest:
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs is not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``. ``prompt`` is one text, one token-id list, or a batch of
    either; each prompt gets ``n`` choices, indexed ``prompt_index * n + sample_index``.
    ``max_tokens`` defaults to 16, as in OpenAI's API."""

    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True  # vLLM's extension: for text prompts
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(
            prompt[0], int) else [prompt]
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts per request")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("prompt must not be empty")
        if any(isinstance(p, list) and any(t < 0 for t in p) for p in prompts):
            raise ValueError("prompt token ids must be >= 0")
        for index, text in enumerate(prompts):
            if isinstance(text, str):
                check_unicode(text, "the prompt" if text is prompt else f"prompt {index}")
        return prompt

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: a list of texts and/or token-id lists, at least one, none empty."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    """One message. ``content`` may be a list of text parts (joined with newlines); other
    part types (images, audio) are not supported by this server and fail validation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, content: Any) -> Any:
        # Said before type validation, so the client reads "only text" rather than a
        # union error about strings.
        if isinstance(content, list):
            for part in content:
                part_type = part.get("type") if isinstance(part, dict) else None
                if part_type != "text":
                    raise ValueError(f"only text content parts are supported, got "
                                     f"{part_type!r}")
        return content

    @field_validator("content")
    @classmethod
    def _check_content_text(cls, content: str | list[TextContentPart] | None) -> Any:
        # After type validation: checked in a part's own validator instead, the error
        # would be reported under the union's first member ("should be a string").
        if isinstance(content, str):
            check_unicode(content, "the content")
        elif content is not None:
            for index, part in enumerate(content):
                check_unicode(part.text, f"content part {index}")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatTemplateFields(OpenAIModel):
    """vLLM's chat-template options, shared by chat generation, ``/tokenize`` and the chat
    render endpoint (``prompt_inputs.render_chat_prompt`` states what each does)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them: ``{"role", "content"}`` dicts."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class ChatCompletionRequest(GenerationRequest, ChatTemplateFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is OpenAI's newer name for
    ``max_tokens``; when both are absent, generation may run to the end of the context."""

    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_chat(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format is not supported")
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


# ---- responses -----------------------------------------------------------------------


class LoadLoRAAdapterRequest(OpenAIModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and
    unused: the name says which adapter)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    """Token counts of one API request.

    ``prompt_tokens`` counts each prompt once, however many choices (``n``) it has, as
    OpenAI does; ``completion_tokens`` sums every choice. ``cached_tokens`` is, per prompt,
    the *smallest* ``num_cached_tokens`` among its ``n`` engine requests (for ``n=1``
    exactly the engine's figure), summed over prompts: it is the part of the prompt that
    the cache served before this API request's own work, never more than ``prompt_tokens``.
    Siblings of one prompt usually hit each other's freshly computed blocks; counting those
    would report a cache benefit the client did not bring.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TokenIdsFields(ResponseModel):
    """The token ids a ``return_token_ids`` request gets, where vLLM puts them.

    A completion choice carries ``prompt_token_ids`` (in a stream: on the choice's first
    chunk only) and ``token_ids`` (in a stream: the chunk's new ids, so the chunks' ids
    concatenate to the choice's). A chat response carries ``prompt_token_ids`` at the top
    (in a stream: on the first chunk only) and ``token_ids`` on each choice. Fields left
    None are left off the wire, so a response without ``return_token_ids`` is unchanged.
    """

    @model_serializer(mode="wrap")
    def _drop_unrequested_token_ids(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in ("prompt_token_ids", "token_ids"):
            if name in data and data[name] is None:
                del data[name]
        return data


class CompletionChoice(TokenIdsFields):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(TokenIdsFields):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(TokenIdsFields):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class DeltaMessage(ResponseModel):
    """A stream delta; absent fields are left off the wire (``{}`` on the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _drop_absent(self) -> dict[str, str]:
        fields = {"role": self.role, "content": self.content}
        return {name: value for name, value in fields.items() if value is not None}


class ChatStreamChoice(TokenIdsFields):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(TokenIdsFields):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixcache"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
