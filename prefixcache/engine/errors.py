"""The engine's errors, as types: callers (the server, the CLI) decide what to tell their
users from the type and the fields, never from the message text.

- :class:`InvalidRequestError` — the engine refused one request (``add_request``): it
  names the request and the field at fault; nothing of it was queued.
- :class:`EngineDeadError` — the engine loop stopped (the engine raised, or AsyncLLM was
  shut down); every later call gets it.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The engine refused request ``request_id``: ``message`` says why in terms of the
    request itself (it does not repeat the id), ``param`` names the request field at
    fault (``"prompt"``, ``"sampling_params"``, ``"request_id"``) or is None.

    A ValueError, so code that catches ValueError for bad input keeps working;
    ``str()`` is ``"request '<id>': <message>"``.
    """

    def __init__(self, request_id: str, message: str, param: str | None = None) -> None:
        super().__init__(request_id, message, param)
        self.request_id = request_id
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return f"request {self.request_id!r}: {self.message}"


class EngineDeadError(RuntimeError):
    """The engine loop stopped (the engine raised, or AsyncLLM was shut down)."""
