"""From a validated OpenAI request to engine requests and back to OpenAI responses.

One API request becomes ``len(prompts) * n`` engine requests added as one group, so they
are batched together and a client that goes away aborts all of them. Choice ``i`` of
prompt ``p`` has index ``p * n + i`` and seed ``seed + i`` (when a seed is given), so the
``n`` choices differ yet the whole response is reproducible.

Checks made here, before the engine sees anything, so each gets a precise 400: the
model name (404), the prompt against the context and the KV pool, and ``max_tokens``
against what the context leaves. The engine re-checks; its refusal
(:class:`~prefixcache.engine.errors.InvalidRequestError`) is a 400 too, naming the prompt
it is about rather than the internal request id.

A request whose ``model`` names a LoRA adapter runs with it (see ``serving_models``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prefixcache.engine.async_llm import AsyncLLM, NewRequest
from prefixcache.engine.errors import EngineDeadError, InvalidRequestError
from prefixcache.engine.output_stream import OutputStream
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.entrypoints.openai.errors import APIError, bad_request, error_body, error_json
from prefixcache.entrypoints.openai.metrics import ServerMetrics
from prefixcache.entrypoints.openai.prompt_inputs import encode_text_prompt, render_chat_prompt
from prefixcache.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    ChatTemplateFields,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    GenerationRequest,
    PromptTokensDetails,
    UsageInfo,
    now_s,
    random_id,
)
from prefixcache.entrypoints.openai.serving_models import ServedModels, lora_api_error
from prefixcache.entrypoints.openai.worker_pool import TokenizerPool
from prefixcache.lora.errors import LoRAError
from prefixcache.lora.request import LoRARequest

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server knows about the loaded model and its KV pool."""

    served_model_names: tuple[str, ...]
    root: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int

    @property
    def kv_pool_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


class PreparedPrompts(NamedTuple):
    """What one API request runs with: the served model name it named, each prompt's
    token ids, and the ``max_tokens`` every choice gets."""

    model: str
    prompts_token_ids: list[list[int]]
    max_tokens: int
    lora_request: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class EventStream:
    """A streamed response: ``events`` yields SSE strings; ``close`` aborts whatever is
    still running and must be called when the response ends, however it ends (the
    iterator's own cleanup does not run if it was never started)."""

    events: AsyncIterator[str]
    close: Callable[[], None]


@dataclass(slots=True)
class _Run:
    """One API request in flight: its engine requests and what they have produced."""

    api_id: str
    model: str
    n: int
    prompts_token_ids: list[list[int]]
    arrival_time: float
    request_id_to_index: dict[str, int]
    is_chat: bool
    return_token_ids: bool = False
    final_outputs: dict[int, RequestOutput] = field(default_factory=dict)
    # Choices whose first token has been timed (an aborted one may have had it too).
    timed_indexes: set[int] = field(default_factory=set)
    # A streamed chat response carries the prompt's ids on its first chunk only.
    sent_prompt_token_ids: bool = False

    def prompt_token_ids_of(self, index: int) -> list[int] | None:
        """Choice ``index``'s prompt ids when the client asked for token ids, else None."""
        return self.prompts_token_ids[index // self.n] if self.return_token_ids else None

    def token_ids_if_requested(self, token_ids: list[int]) -> list[int] | None:
        return token_ids if self.return_token_ids else None

    def usage(self) -> UsageInfo:
        completion_tokens = sum(len(o.token_ids) for o in self.final_outputs.values())
        prompt_tokens = sum(len(t) for t in self.prompts_token_ids)
        cached_tokens = 0
        for prompt_index in range(len(self.prompts_token_ids)):
            # Smallest over the prompt's n choices (see UsageInfo's contract).
            choices = [self.final_outputs.get(prompt_index * self.n + i)
                       for i in range(self.n)]
            cached_tokens += min((o.num_cached_tokens for o in choices if o is not None),
                                 default=0)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class OpenAIServing:
    """Serves ``/v1/completions`` and ``/v1/chat/completions`` over one AsyncLLM.

    ``create_*`` return a response model, or for ``stream: true`` an :class:`EventStream`
    of server-sent-event strings (ending with ``data: [DONE]``). They raise APIError for
    anything the client must fix.
    """

    def __init__(self, llm: AsyncLLM, tokenizer: Any, model_info: ModelInfo,
                 metrics: ServerMetrics, tokenizer_pool: TokenizerPool | None = None,
                 served_models: ServedModels | None = None) -> None:
        """``served_models``: the base model's names and the adapters (default: the
        base model's names alone)."""
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.metrics = metrics
        self.served_models = served_models or ServedModels(
            llm, model_info.served_model_names, model_info.root, model_info.max_model_len)
        # Large prompts are tokenized off the event loop (see worker_pool).
        self.tokenizer_pool = tokenizer_pool or TokenizerPool(1)

    # ---- endpoints ---------------------------------------------------------------------

    async def create_completion(self, request: CompletionRequest,
                                cache_salt: str | None) -> CompletionResponse | EventStream:
        arrival_time = time.time()
        model, prompts_token_ids, max_tokens, lora_request = \
            await self.prepare_completion(request)
        run, stream = await self._start(request, prompts_token_ids, max_tokens, cache_salt,
                                        "cmpl", model, arrival_time, lora_request)
        if request.stream:
            return EventStream(self._stream_events(run, stream, request.include_usage_in_stream,
                                                   self._completion_chunks), stream.abort)
        await self._drain(run, stream)
        choices = [CompletionChoice(index=index, text=output.text,
                                    finish_reason=output.finish_reason,
                                    prompt_token_ids=run.prompt_token_ids_of(index),
                                    token_ids=run.token_ids_if_requested(output.token_ids))
                   for index, output in sorted(run.final_outputs.items())]
        return CompletionResponse(id=run.api_id, created=now_s(), model=model,
                                  choices=choices, usage=run.usage())

    async def create_chat_completion(
        self, request: ChatCompletionRequest, cache_salt: str | None
    ) -> ChatCompletionResponse | EventStream:
        arrival_time = time.time()
        model, prompts_token_ids, max_tokens, lora_request = await self.prepare_chat(request)
        run, stream = await self._start(request, prompts_token_ids, max_tokens, cache_salt,
                                        "chatcmpl", model, arrival_time, lora_request)
        if request.stream:
            return EventStream(self._stream_events(run, stream, request.include_usage_in_stream,
                                                   self._chat_chunks), stream.abort)
        await self._drain(run, stream)
        choices = [ChatChoice(index=index, message=AssistantMessage(content=output.text),
                              finish_reason=output.finish_reason,
                              token_ids=run.token_ids_if_requested(output.token_ids))
                   for index, output in sorted(run.final_outputs.items())]
        return ChatCompletionResponse(id=run.api_id, created=now_s(), model=model,
                                      choices=choices, usage=run.usage(),
                                      prompt_token_ids=run.prompt_token_ids_of(0))

    # ---- request side ------------------------------------------------------------------

    async def _encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True
                             ) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return await self.tokenizer_pool.run(len(prompt), functools.partial(
            encode_text_prompt, self.tokenizer, prompt, add_special_tokens=add_special_tokens))

    async def _render_chat(self, request: ChatTemplateFields) -> list[int]:
        messages = request.chat_messages()
        num_chars = sum(len(message.get("content") or "") for message in messages)
        return await self.tokenizer_pool.run(num_chars, functools.partial(
            render_chat_prompt, self.tokenizer, messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            add_special_tokens=request.add_special_tokens,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs))

    # ---- shared with the tokenization endpoints (serving_tokenization) -----------------

    async def prepare_completion(self, request: CompletionRequest) -> PreparedPrompts:
        """The model name, the prompts' token ids and ``max_tokens`` a completion request
        runs with: what ``create_completion`` sends to the engine."""
        model, lora_request = self.served_models.resolve(request.model)
        prompts_token_ids = [await self._encode_prompt(p, request.add_special_tokens)
                             for p in request.prompts()]
        max_tokens = request.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        return PreparedPrompts(model, prompts_token_ids, max_tokens, lora_request)

    async def prepare_chat(self, request: ChatCompletionRequest) -> PreparedPrompts:
        """As ``prepare_completion``, for a chat request (one prompt)."""
        model, lora_request = self.served_models.resolve(request.model)
        prompt_token_ids = await self._render_chat(request)
        # Chat has no default cap in OpenAI's API: the context's remainder is the limit.
        max_tokens = request.requested_max_tokens
        if max_tokens is None:
            max_tokens = max(self.model_info.max_model_len - len(prompt_token_ids), 1)
        return PreparedPrompts(model, [prompt_token_ids], max_tokens, lora_request)

    def _check_lengths(self, num_prompt_tokens: int, max_tokens: int) -> None:
        info = self.model_info
        if num_prompt_tokens >= info.max_model_len:
            raise bad_request(
                f"the prompt has {num_prompt_tokens} tokens, but the model's context is "
                f"{info.max_model_len} tokens and at least one must be left to generate",
                param="prompt", code="context_length_exceeded")
        if num_prompt_tokens > info.kv_pool_tokens:
            raise bad_request(
                f"the prompt has {num_prompt_tokens} tokens, more than the whole KV cache "
                f"({info.num_kv_blocks} blocks of {info.block_size} tokens) can hold",
                param="prompt", code="context_length_exceeded")
        if num_prompt_tokens + max_tokens > info.max_model_len:
            raise bad_request(
                f"max_tokens={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds "
                f"the model's context of {info.max_model_len} tokens; use at most "
                f"{info.max_model_len - num_prompt_tokens}",
                param="max_tokens", code="context_length_exceeded")

    def _sampling_params(self, request: GenerationRequest, max_tokens: int,
                         choice_index: int) -> SamplingParams:
        seed = None if request.seed is None else request.seed + choice_index
        params = SamplingParams(
            n=1, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            seed=seed, max_tokens=max_tokens, stop=request.stop,
            stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos)
        try:
            params.validate()
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        return params

    async def _start(self, request: GenerationRequest, prompts_token_ids: list[list[int]],
                     max_tokens: int, cache_salt: str | None, id_prefix: str, model: str,
                     arrival_time: float, lora_request: LoRARequest | None = None,
                     ) -> tuple[_Run, OutputStream]:
        for token_ids in prompts_token_ids:
            self._check_lengths(len(token_ids), max_tokens)
        api_id = random_id(id_prefix)
        n = request.n
        new_requests = []
        request_id_to_index = {}
        for prompt_index, token_ids in enumerate(prompts_token_ids):
            for choice in range(n):
                request_id = f"{api_id}-{prompt_index}-{choice}"
                request_id_to_index[request_id] = prompt_index * n + choice
                new_requests.append(NewRequest(
                    request_id, token_ids, self._sampling_params(request, max_tokens, choice),
                    cache_salt, arrival_time, lora_request))
        try:
            stream = await self.llm.add_requests(new_requests)
        except InvalidRequestError as exc:
            if isinstance(exc.__cause__, LoRAError):
                raise lora_api_error(exc.__cause__, param="model") from exc
            index = request_id_to_index.get(exc.request_id)
            message = exc.message
            if len(prompts_token_ids) > 1 and index is not None:
                message = f"prompt {index // n}: {message}"
            raise bad_request(message, param=exc.param) from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from exc
        run = _Run(api_id, model, n, prompts_token_ids, arrival_time, request_id_to_index,
                   is_chat=id_prefix == "chatcmpl",
                   return_token_ids=bool(request.return_token_ids))
        return run, stream

    # ---- response side -----------------------------------------------------------------

    def _record(self, run: _Run, output: RequestOutput) -> int:
        """File one output under its choice and record its metrics: time to first token
        on the choice's first token, the finish on its last output."""
        index = run.request_id_to_index[output.request_id]
        metrics = output.metrics
        if metrics is not None and metrics.time_to_first_token is not None \
                and index not in run.timed_indexes:
            run.timed_indexes.add(index)
            self.metrics.observe_first_token(metrics.time_to_first_token)
        if output.finished:
            run.final_outputs[index] = output
            finished_time = (metrics.finished_time if metrics is not None else None) \
                or time.time()
            self.metrics.observe_finished(output.finish_reason,
                                          finished_time - run.arrival_time)
        return index

    def _record_abandoned(self, run: _Run) -> None:
        # Choices the client never waited for: count them as aborted.
        num_unfinished = len(run.request_id_to_index) - len(run.final_outputs)
        for _ in range(num_unfinished):
            self.metrics.observe_finished("abort", time.time() - run.arrival_time)

    async def _drain(self, run: _Run, stream: OutputStream) -> None:
        try:
            async with stream:
                async for output in stream:
                    self._record(run, output)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from exc
        finally:
            if len(run.final_outputs) < len(run.request_id_to_index):
                self._record_abandoned(run)
        errors = [o.error or "generation failed" for o in run.final_outputs.values()
                  if o.finish_reason == "error"]
        if errors:
            raise APIError(500, errors[0], code="generation_error")

    async def _stream_events(
        self, run: _Run, stream: OutputStream, include_usage: bool,
        make_chunks: Callable[[_Run, int, RequestOutput, bool], list[str]],
    ) -> AsyncIterator[str]:
        """SSE lines for a streamed response; aborts the group if the consumer stops."""
        started: set[int] = set()
        try:
            async with stream:
                async for output in stream:
                    index = self._record(run, output)
                    first = index not in started
                    started.add(index)
                    for chunk in make_chunks(run, index, output, first):
                        yield f"data: {chunk}\n\n"
            errors = [o.error or "generation failed" for o in run.final_outputs.values()
                      if o.finish_reason == "error"]
            if errors:
                yield f"data: {error_json(error_body(500, errors[0], code='generation_error'))}\n\n"
            elif include_usage:
                usage_chunk = self._usage_chunk(run)
                yield f"data: {usage_chunk}\n\n"
            yield "data: [DONE]\n\n"
        except EngineDeadError as exc:
            yield f"data: {error_json(error_body(503, str(exc), code='engine_unavailable'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if len(run.final_outputs) < len(run.request_id_to_index):
                self._record_abandoned(run)

    def _usage_chunk(self, run: _Run) -> str:
        if run.is_chat:
            return ChatCompletionStreamResponse(
                id=run.api_id, created=now_s(), model=run.model, choices=[],
                usage=run.usage()).model_dump_json()
        return CompletionStreamResponse(id=run.api_id, created=now_s(), model=run.model,
                                        choices=[], usage=run.usage()).model_dump_json()

    @staticmethod
    def _completion_chunks(run: _Run, index: int, output: RequestOutput,
                           first: bool) -> list[str]:
        has_new_ids = run.return_token_ids and (first or output.new_token_ids)
        if not output.new_text and not output.finished and not has_new_ids:
            return []
        choice = CompletionChoice(index=index, text=output.new_text,
                                  finish_reason=output.finish_reason,
                                  prompt_token_ids=run.prompt_token_ids_of(index) if first
                                  else None,
                                  token_ids=run.token_ids_if_requested(output.new_token_ids))
        return [CompletionStreamResponse(id=run.api_id, created=now_s(), model=run.model,
                                         choices=[choice]).model_dump_json()]

    @staticmethod
    def _chat_chunks(run: _Run, index: int, output: RequestOutput, first: bool) -> list[str]:
        chunks = []
        if first:  # OpenAI opens each choice with the role and empty content
            chunks.append(ChatStreamChoice(index=index,
                                           delta=DeltaMessage(role="assistant", content="")))
        if output.new_text or output.finished \
                or (run.return_token_ids and output.new_token_ids):
            content = output.new_text or None
            chunks.append(ChatStreamChoice(
                index=index, delta=DeltaMessage(content=content),
                finish_reason=output.finish_reason,
                token_ids=run.token_ids_if_requested(output.new_token_ids)))
        responses = []
        for choice in chunks:
            prompt_token_ids = None
            if run.return_token_ids and not run.sent_prompt_token_ids:
                prompt_token_ids = run.prompt_token_ids_of(0)
                run.sent_prompt_token_ids = True
            responses.append(ChatCompletionStreamResponse(
                id=run.api_id, created=now_s(), model=run.model, choices=[choice],
                prompt_token_ids=prompt_token_ids).model_dump_json())
        return responses

