"""OpenAI-style errors: one exception type, one JSON shape, one place mapping to statuses.

Every error the server returns has the body OpenAI's API uses, which the ``openai``
client turns into typed exceptions (``BadRequestError``, ``NotFoundError``, ...)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

and is written by :func:`error_json`, whatever sends it (an exception handler, the body
size middleware before any route runs, or an event of a stream), so every error reads the
same on the wire: compact, like every other response of the server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

_STATUS_TO_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error to return to the client with ``status``; ``message`` is shown to it."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    error_type = _STATUS_TO_TYPE.get(status, "server_error" if status >= 500
                                     else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_json(body: dict[str, Any]) -> str:
    """``body`` as JSON text, compact like FastAPI's and pydantic's output (no spaces
    after separators, non-ASCII as is). A lone surrogate that reached a message (an echo of
    bad input) is written as its JSON escape rather than failing the response."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, body: dict[str, Any],
                   headers: Mapping[str, str] | None = None) -> Response:
    """The HTTP response carrying an :func:`error_body`."""
    return Response(error_json(body), status_code=status, headers=headers,
                    media_type="application/json")


def bad_request(message: str, *, param: str | None = None,
                code: str | None = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(error: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a request body.

    Pydantic's location for a union member includes the member's type (``prompt.str``);
    the reported ``param`` keeps only the field path a client wrote.
    """
    first = error.errors(include_url=False)[0]
    path = [str(part) for part in first["loc"] if isinstance(part, (str, int))]
    field_path = []
    for part in path:
        if part in _UNION_TAGS or "[" in part:
            break
        field_path.append(part)
    param = ".".join(field_path) or None
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if first["type"] == "missing":
        message = "field required"
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{message}", param=param)


# Type names pydantic puts into union error locations; never field names of ours.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after",
                         "TextContentPart", "list[int]", "list[str]", "list[list[int]]",
                         "list[TextContentPart]"})
