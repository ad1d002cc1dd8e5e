"""The offline API: :class:`LLM` runs a batch of prompts to completion on an
:class:`~prefixcache.engine.llm_engine.LLMEngine`."""

from __future__ import annotations

import inspect
import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from prefixcache.engine.arg_utils import EngineArgs
from prefixcache.engine.errors import InvalidRequestError
from prefixcache.engine.llm_engine import LLMEngine
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.stats import EngineStats
from prefixcache.lora.request import LoRARequest
from prefixcache.model.loader import LoadedModel

# A progress bar is worth drawing only for batches at least this large.
_MIN_REQUESTS_FOR_PROGRESS_BAR = 8

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


class LLM:
    """Generate text for batches of prompts with automatic prefix caching.

    ``model`` is None (the default SmolLM2-135M-Instruct), a ``.gguf`` file, a Hugging Face
    model folder or a :class:`LoadedModel`. The keyword options are the fields of
    :class:`~prefixcache.engine.arg_utils.EngineArgs`, which documents them and their
    defaults (``inspect.signature(LLM)`` lists them too). Raises ValueError for a bad
    option or a model that cannot be loaded, FileNotFoundError for a missing one,
    TypeError for an unknown option.
    """

    def __init__(self, model: str | LoadedModel | None = None, **options: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model, **options))
        self.tokenizer = self.engine.tokenizer
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; returns one output per prompt, in input order.

        ``prompts`` is a string, a list of token ids, or a list of either. Strings are
        encoded with the tokenizer's special tokens (e.g. BOS). ``sampling_params`` is one
        for all prompts, one per prompt, or None for ``SamplingParams()``.

        With ``n > 1`` a prompt runs as ``n`` requests (seeds ``seed``, ``seed + 1``, ...
        when seeded); its output's ``outputs`` lists all ``n`` samples and its top-level
        fields repeat sample 0. With ``n == 1`` ``outputs`` holds the one sample, so
        ``output.outputs`` can always be iterated.

        ``lora_request`` runs every prompt with one LoRA adapter, or gives one per prompt
        (None for the base model); the engine needs ``enable_lora=True``.

        Raises ValueError before anything runs if any prompt, params or adapter is invalid.
        """
        prompt_list = _as_prompt_list(prompts)
        return self._run(
            [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt_list],
            sampling_params,
            use_tqdm,
            lora_request,
        )

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Like :meth:`generate` for one conversation (a list of ``{"role", "content"}``
        dicts) or a list of conversations, rendered with the model's chat template (or
        ``chat_template``). Returns one output per conversation; ``prompt`` holds the
        rendered text. ``lora_request`` as for :meth:`generate`, per conversation."""
        if not messages:
            raise ValueError("messages must be a non-empty conversation or list of them")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts: list[tuple[str | None, list[int]]] = []
        for conversation in conversations:
            if not conversation or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in conversation
            ):
                # A template renders a missing key as nothing, so say it here.
                raise ValueError("a conversation must be a non-empty list of "
                                 "{'role': str, 'content': str} dicts")
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            # The template already wrote any BOS the model wants.
            prompts.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def reset_prefix_cache(self, reset_kv_tier: bool = False) -> bool:
        """Forget every cached block (e.g. between benchmark runs); with
        ``reset_kv_tier``, this engine's blocks in its KV tier too."""
        return self.engine.reset_prefix_cache(reset_kv_tier)

    def close(self) -> None:
        """Write the KV tier's queued blocks and release it (nothing else to release)."""
        self.engine.close()

    def get_stats(self) -> EngineStats:
        """The engine's counters and gauges (see :class:`EngineStats`)."""
        return self.engine.get_stats()

    # -- running a batch --------------------------------------------------------------------

    def _run(
        self,
        prompts: list[tuple[str | None, list[int] | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[RequestOutput]:
        params_list = _params_per_prompt(sampling_params, len(prompts))
        lora_list = _lora_per_prompt(lora_request, len(prompts))
        # Tokenize and validate everything before queueing anything.
        requests: list[tuple[int, str, str | None, list[int], SamplingParams,
                             LoRARequest | None]] = []
        base_ids: list[str] = []
        for index, ((text, token_ids), params) in enumerate(zip(prompts, params_list,
                                                                 strict=True)):
            params.validate()
            if token_ids is None:
                token_ids = self.tokenizer.encode(text)
            if not token_ids:  # said here: the engine's message names an internal id
                raise ValueError(f"prompt {index} is empty")
            base_id = str(next(self._request_counter))
            base_ids.append(base_id)
            for sample in range(params.n):
                sample_params = params
                if params.n > 1:
                    sample_params = _one_sample(params, sample)
                request_id = base_id if params.n == 1 else f"{base_id}-{sample}"
                requests.append((index, request_id, text, token_ids, sample_params,
                                 lora_list[index]))
        added: list[str] = []
        try:
            for index, request_id, text, token_ids, params, lora in requests:
                try:
                    self.engine.add_request(request_id, token_ids, params, prompt=text,
                                            lora_request=lora)
                except InvalidRequestError as error:
                    # Said in the caller's terms: the request id is internal.
                    raise ValueError(f"prompt {index}: {error.message}") from error
                added.append(request_id)
        except Exception:
            self.engine.abort_request(added)
            while self.engine.has_unfinished_requests():
                self.engine.step()  # deliver (and drop) the aborts
            raise

        request_id_to_output: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(requests), use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        request_id_to_output[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            self.engine.abort_request(r[1] for r in requests)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        finally:
            if progress is not None:
                progress.close()

        samples_per_prompt: list[list[RequestOutput]] = [[] for _ in prompts]
        for index, request_id, *_ in requests:
            samples_per_prompt[index].append(request_id_to_output[request_id])
        results = []
        for base_id, samples in zip(base_ids, samples_per_prompt, strict=True):
            first = samples[0]
            result = RequestOutput(**{name: getattr(first, name)
                                      for name in RequestOutput.__slots__ if name != "outputs"})
            result.request_id = base_id
            result.outputs = samples
            results.append(result)
        return results


# The options as keyword parameters, for help() and editors: EngineArgs' own signature.
LLM.__init__.__signature__ = inspect.Signature([
    inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    *inspect.signature(EngineArgs).parameters.values(),
])


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty "
                         "list of those")
    if all(isinstance(p, int) for p in prompts):
        return [prompts]
    for prompt in prompts:
        if isinstance(prompt, str):
            continue
        if not isinstance(prompt, Sequence) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"each prompt must be a string or a list of token ids, "
                             f"got {prompt!r:.80}")
    return list(prompts)


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(f"got {len(params_list)} sampling params for {num_prompts} prompts")
    if not all(isinstance(p, SamplingParams) for p in params_list):
        raise ValueError("sampling_params must be SamplingParams or a list of them")
    return params_list


def _lora_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (None for "
                         f"the base model) or None, got {type(lora_request).__name__}")
    lora_list = list(lora_request)
    if len(lora_list) != num_prompts:
        raise ValueError(f"got {len(lora_list)} LoRA requests for {num_prompts} prompts")
    for lora in lora_list:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"each lora_request must be a LoRARequest or None, got "
                             f"{type(lora).__name__}")
    return lora_list


def _one_sample(params: SamplingParams, sample: int) -> SamplingParams:
    """Params of sample ``sample`` of ``params.n``: n=1, and a distinct seed if seeded."""
    seed = None if params.seed is None else params.seed + sample
    return SamplingParams(
        n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=seed, max_tokens=params.max_tokens, stop=params.stop,
        stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
    )


def _progress_bar(total: int, use_tqdm: bool):
    if not use_tqdm or total < _MIN_REQUESTS_FOR_PROGRESS_BAR or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit="req", file=sys.stderr)
