"""uvicorn's h11 protocol with two limits of its own on the request head: its size in
bytes and the time it may take to arrive.

Why here and not in the app: the app sees a request only once its head is complete, so a
client that never completes one (slowloris) never reaches it. h11 bounds a head only while
it arrives in pieces (``max_incomplete_event_size``, answered by uvicorn with a plain 400)
and uvicorn times out only idle keep-alive connections, never one that sent half a head,
nor a new connection that sends nothing. This protocol:

* answers **431** and closes the connection once the bytes buffered for a head pass
  ``max_head_bytes`` without the blank line that ends it, whether the head came in one
  piece or many, so no complete head is ever longer than the limit;
* answers **408** and closes a connection whose head has not arrived ``head_timeout_s``
  seconds after the connection opened or its previous response ended (a connection that
  sent nothing at all is just closed).

The time limit on the body is the app's (:mod:`~prefixcache.entrypoints.openai.limits`).
Both answers are OpenAI's error JSON, written raw: h11 cannot send a response to a
request it has not parsed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from prefixcache.entrypoints.openai.errors import error_body, error_json
from prefixcache.entrypoints.openai.limits import STATUS_TO_CODE

logger = logging.getLogger(__name__)

# A head ends at its first empty line; h11 accepts bare LF line endings too.
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n", b"\n\r\n")
# asyncio hands a protocol at most this much per data_received (its selector transports'
# read size): h11's own limit is set above our limit plus one read, so ours answers first.
_MAX_READ_BYTES = 256 * 1024


def protocol_factory(max_head_bytes: int, head_timeout_s: float) -> Any:
    """What to pass as ``uvicorn.Config(http=...)``."""
    return functools.partial(LimitedH11Protocol, max_head_bytes=max_head_bytes,
                             head_timeout_s=head_timeout_s)


def h11_buffer_bytes(max_head_bytes: int) -> int:
    """The ``h11_max_incomplete_event_size`` to give uvicorn with :func:`protocol_factory`."""
    return max_head_bytes + 2 * _MAX_READ_BYTES


class LimitedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with the head limits of the module docstring."""

    def __init__(self, *args: Any, max_head_bytes: int, head_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = max_head_bytes
        self.head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    # ---- the head's time limit ---------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._awaiting_head():
            self._arm_head_timer()
        else:  # a pipelined request's head was already buffered
            self._cancel_head_timer()

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self._awaiting_head():
            return
        if self.conn.trailing_data[0]:
            logger.info("%s: no complete request head within %gs; answered 408",
                        self._peer(), self.head_timeout_s)
            self._refuse(408, f"the request head did not arrive within "
                              f"{self.head_timeout_s:g} seconds")
        else:
            logger.debug("%s: nothing sent within %gs; connection closed", self._peer(),
                         self.head_timeout_s)
            self.transport.close()

    # ---- the head's size limit ---------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            logger.info("%s: request head over %d bytes; answered 431", self._peer(),
                        self.max_head_bytes)
            self._refuse(431, f"the request head is larger than {self.max_head_bytes} bytes")
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def _head_too_large(self, data: bytes) -> bool:
        buffered = self.conn.trailing_data[0]
        if len(buffered) + len(data) <= self.max_head_bytes:
            return False
        window = (buffered + data)[:self.max_head_bytes]
        return not any(end in window for end in _HEAD_ENDS)

    # ---- answers -----------------------------------------------------------------------

    def _refuse(self, status: int, message: str) -> None:
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        body = error_json(error_body(status, message, code=STATUS_TO_CODE.get(status))) \
            .encode("utf-8")
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n" % (status, reason, len(body)))
        self.transport.write(head + body)
        self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"
