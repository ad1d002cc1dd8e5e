"""What AsyncLLM's callers hand to the engine loop (see :mod:`prefixcache.engine.async_llm`).

:class:`NewRequest` is one engine request to add. The commands (:class:`Add`,
:class:`Abort`, :class:`Reset`, :class:`Call`, :class:`Shutdown`) go from an asyncio event
loop to the engine loop's thread through AsyncLLM's command queue, in arrival order. Each
one that has a ``done`` future is answered by settling it on the ``loop`` it came from;
an abort needs no answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixcache.engine.output_stream import OutputStream

if TYPE_CHECKING:
    from prefixcache.engine.sampling_params import SamplingParams
    from prefixcache.lora.request import LoRARequest


@dataclass(frozen=True, slots=True)
class NewRequest:
    """One engine request to add: the arguments of ``LLMEngine.add_request``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class Add:
    requests: list[NewRequest]
    stream: OutputStream
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass(slots=True)
class Abort:
    request_ids: list[str]
    # Abort only the ids that belong to this stream; None aborts whoever holds them.
    stream: OutputStream | None


@dataclass(slots=True)
class Reset:
    wait: bool
    abort_running: bool
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    reset_kv_tier: bool = False


@dataclass(slots=True)
class Call:
    """Run ``function(engine)`` on the engine loop's thread; its result or exception
    settles ``done``."""

    function: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass(slots=True)
class Shutdown:
    pass
