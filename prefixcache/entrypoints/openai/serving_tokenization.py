"""vLLM's tokenization endpoints: ``/tokenize``, ``/detokenize`` and the two ``/render`` ones.

Cache-aware routers (vllm-router's ``kv_aware`` policy) never tokenize themselves: they
ask a worker for a request's prompt token ids, first at the render endpoint matching the
request (``/v1/completions/render``, ``/v1/chat/completions/render``), then at
``/tokenize``, and match those ids against the ``token_ids`` of the worker's KV events.
So the ids must be exactly the ones generation caches. They are: every endpoint here goes
through ``OpenAIServing.prepare_completion`` / ``prepare_chat`` (or, for ``/tokenize``,
the same ``prompt_inputs`` functions those call) with the same request fields.

Shapes, as vLLM's:

* ``POST /tokenize`` ``{model?, prompt, add_special_tokens=true}`` or ``{model?, messages,
  add_generation_prompt=true, continue_final_message=false, add_special_tokens=false,
  chat_template_kwargs?}`` (+ ``return_token_strs``) -> ``{count, max_model_len, tokens,
  token_strs}``. Lengths are not checked against the context: ``max_model_len`` is there
  for the client to compare.
* ``POST /detokenize`` ``{model?, tokens}`` -> ``{prompt}``; ids outside the vocabulary are
  a 400.
* ``POST /v1/completions/render`` takes a ``/v1/completions`` body and answers a list with
  one generate request per prompt; ``POST /v1/chat/completions/render`` takes a
  ``/v1/chat/completions`` body and answers one generate request:
  ``{request_id, token_ids, features, sampling_params, model, stream, cache_salt,
  priority}``. The body is validated exactly as generation validates it, lengths included,
  so a render succeeds exactly when the request would be admitted.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from prefixcache.entrypoints.openai.errors import bad_request
from prefixcache.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    GenerationRequest,
    OpenAIModel,
    ResponseModel,
    random_id,
)
from prefixcache.entrypoints.openai.serving import OpenAIServing, PreparedPrompts
from prefixcache.entrypoints.openai.unicode_text import check_unicode


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str = Field(min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str) -> str:
        return check_unicode(prompt, "the prompt")


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    return_token_strs: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class RenderedRequest(ResponseModel):
    """vLLM's ``GenerateRequest``: a request rendered to token ids, ready for an engine."""

    request_id: str
    token_ids: list[int]
    features: None = None
    sampling_params: dict[str, Any]
    model: str
    stream: bool = False
    cache_salt: str | None = None
    priority: int = 0


def tokenize_request_class(body: dict[str, Any]) -> type[OpenAIModel]:
    """The ``/tokenize`` body's type: chat when it carries ``messages``, as in vLLM."""
    return TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest


class OpenAIServingTokenization:
    """The four endpoints over the generation side's own preparation (``serving``)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest
                       ) -> TokenizeResponse:
        serving = self.serving
        serving.served_models.resolve(request.model)
        if isinstance(request, TokenizeChatRequest):
            token_ids = await serving._render_chat(request)
        else:
            token_ids = await serving._encode_prompt(request.prompt, request.add_special_tokens)
        token_strs = None
        if request.return_token_strs:
            token_strs = [self.tokenizer.backend.id_to_token(t) or "" for t in token_ids]
        return TokenizeResponse(count=len(token_ids),
                                max_model_len=serving.model_info.max_model_len,
                                tokens=token_ids, token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.serving.served_models.resolve(request.model)
        vocab_size = self.tokenizer.vocab_size
        for index, token_id in enumerate(request.tokens):
            if not 0 <= token_id < vocab_size:
                raise bad_request(f"tokens[{index}] = {token_id} is not a token id of this "
                                  f"model (0 .. {vocab_size - 1})", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    async def render_completion(self, request: CompletionRequest) -> list[RenderedRequest]:
        prepared = await self.serving.prepare_completion(request)
        return self._rendered(request, prepared)

    async def render_chat(self, request: ChatCompletionRequest) -> RenderedRequest:
        prepared = await self.serving.prepare_chat(request)
        return self._rendered(request, prepared)[0]

    def _rendered(self, request: GenerationRequest, prepared: PreparedPrompts
                  ) -> list[RenderedRequest]:
        serving = self.serving
        rendered = []
        vocab_size = self.tokenizer.vocab_size
        for index, token_ids in enumerate(prepared.prompts_token_ids):
            serving._check_lengths(len(token_ids), prepared.max_tokens)
            # The engine refuses these when generating; a render must not accept them.
            if any(not 0 <= t < vocab_size for t in token_ids):
                where = "" if len(prepared.prompts_token_ids) == 1 else f"prompt {index}: "
                raise bad_request(f"{where}the prompt holds a token id outside the model's "
                                  f"vocabulary (0 .. {vocab_size - 1})", param="prompt")
            params = serving._sampling_params(request, prepared.max_tokens, 0)
            rendered.append(RenderedRequest(
                request_id=random_id("render"), token_ids=token_ids,
                sampling_params=_sampling_params_dict(params), model=prepared.model,
                stream=request.stream, cache_salt=request.cache_salt))
        return rendered


def _sampling_params_dict(params: Any) -> dict[str, Any]:
    return {name: getattr(params, name) for name in params.__slots__}
