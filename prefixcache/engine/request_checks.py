"""The checks a new request passes before an engine takes it: its sampling params, its
prompt against the model's vocabulary and context length, the type of its LoRA request.
What depends on the engine's state (an id in use, the KV pool, loading the adapter) is the
engine's own to check."""

from __future__ import annotations

from collections.abc import Iterable

from prefixcache.engine.errors import InvalidRequestError
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.lora.request import LoRARequest


def check_new_request(request_id: str, prompt_token_ids: Iterable[int],
                      sampling_params: SamplingParams, lora_request: LoRARequest | None, *,
                      vocab_size: int, max_model_len: int) -> list[int]:
    """Returns the prompt as a list. Raises :class:`InvalidRequestError`, checking in this
    order: ``sampling_params`` not a SamplingParams or invalid (``param`` None: the message
    names the parameter); an empty prompt, a token id outside ``0..vocab_size - 1``, a
    prompt plus ``max_tokens`` beyond ``max_model_len`` (``"prompt"``); ``lora_request``
    neither None nor a LoRARequest (``"lora_request"``)."""
    if not isinstance(sampling_params, SamplingParams):
        raise InvalidRequestError(
            request_id,
            f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}"
        )
    try:
        sampling_params.validate()
    except ValueError as error:
        raise InvalidRequestError(request_id, str(error)) from error
    prompt_token_ids = list(prompt_token_ids)
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens == 0:
        raise InvalidRequestError(request_id, "the prompt is empty", "prompt")
    for token_id in prompt_token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) \
                or not 0 <= token_id < vocab_size:
            raise InvalidRequestError(request_id, f"prompt token {token_id!r} is not a "
                                      f"token id of this model (0..{vocab_size - 1})",
                                      "prompt")
    if num_prompt_tokens + sampling_params.max_tokens > max_model_len:
        raise InvalidRequestError(
            request_id,
            f"prompt ({num_prompt_tokens} tokens) + max_tokens "
            f"({sampling_params.max_tokens}) exceeds the model's context length "
            f"max_model_len={max_model_len}",
            "prompt",
        )
    if lora_request is not None and not isinstance(lora_request, LoRARequest):
        raise InvalidRequestError(request_id, f"lora_request must be a LoRARequest, "
                                  f"got {type(lora_request).__name__}", "lora_request")
    return prompt_token_ids
