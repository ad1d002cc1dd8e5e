"""A bounded pool of threads for the server's CPU work on large inputs: tokenizing prompts
and rendering chat templates.

Small inputs are handled inline, on the event loop, where a thread hop would cost more than
the work; an input of ``INLINE_MAX_CHARS`` characters or more goes to one of the pool's
``num_threads`` threads, so ``/health``, ``/metrics`` and small requests keep being
answered while it is tokenized (the tokenizer releases the GIL while it works, see
:meth:`prefixcache.model.tokenizer.Tokenizer.encode`). The pool bounds how many such jobs
run at once; how many may wait is bounded by admission (per-tenant limits) and by
``--max-prompt-bytes``. Detokenization needs no pool: the engine thread does it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

INLINE_MAX_CHARS = 16 * 1024

Result = TypeVar("Result")


class TokenizerPool:
    """Runs ``work`` inline or on the pool depending on its input's size."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenizer")

    async def run(self, num_chars: int, work: Callable[..., Result], *args: object) -> Result:
        """``work(*args)``, on a pool thread when ``num_chars`` (the input's size) is large.
        Cancelling the caller abandons the result; the thread finishes the job anyway."""
        if num_chars < INLINE_MAX_CHARS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def shutdown(self) -> None:
        """Drop queued jobs; running ones end by themselves (threads are not killed)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
