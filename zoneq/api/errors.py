"""One place where failures become HTTP answers: JSON bodies, the right status for whose
fault it was.

* the client's: 400 (bad input, named), 404 (no such message, zone or route), 405, 409 (the
  operation does not apply to the message's state now, or the suppression plugin that
  would consult a list is not enabled), 413 (over the size limit);
* ours, local and temporary (storage refusing writes, the free-space floor, a suppression
  list file that cannot be read or written): 503 with
  ``Retry-After``, the HTTP form of SMTP's 4xx: nothing was stored, try again;
* ours and unexpected (a bug): 500, still a JSON body, with the traceback in the log.

Only exceptions that say "the request was wrong" are 400: ``BadRequest`` (raised where the
API reads what the client sent: the path, the query, the JSON body), ``Unacceptable`` (the
intake's and the suppression list's verdict on an address or a message) and
``BadCursor``.  A bare ``ValueError`` is not one of them: raised anywhere behind a handler
it is a fault of ours, and blaming the client for it would hide it (RFC 9110 section 15.5:
a 4xx says the client erred; 15.6: 5xx says the server did).
"""

from __future__ import annotations

import logging
from typing import Final, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import BaseModel, ValidationError

from zoneq.api.suppression_list import Unavailable
from zoneq.errors import NotFound, StorageCorruption, TemporaryFailure
from zoneq.logs import REPEATS
from zoneq.queue.admin import BadCursor
from zoneq.queue.intake import TooLarge, Unacceptable

log = logging.getLogger("zoneq.api")

RETRY_AFTER_S: Final = "30"
INTERNAL: Final = "internal error (a fault of the server's, logged there)"

Model = TypeVar("Model", bound=BaseModel)


class Conflict(Exception):
    """The operation does not apply to what the message is now (say, nothing held)."""


class BadRequest(Exception):
    """What the client sent is wrong (a path or query value, a JSON body): 400, named."""


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"status": status, "message": message}}
    return web.json_response(body, status=status, headers=headers)


def _validation_text(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def parse_body(model: type[Model], raw: bytes) -> Model:
    """The request's JSON body as ``model``, or ``BadRequest`` naming each problem.

    Converted here, where the client's input is read, rather than in the middleware: a
    ``ValidationError`` from building an answer would be our bug, not the client's."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BadRequest(_validation_text(exc)) from None


# Whose fault, by exception type; first match wins.
_CLIENT_FAULTS: Final[tuple[tuple[type[Exception], int], ...]] = (
    (NotFound, 404),
    (BadRequest, 400),
    (Unacceptable, 400),
    (BadCursor, 400),
    (TooLarge, 413),
    (Conflict, 409),
)
_CLIENT_TYPES: Final = tuple(kind for kind, _ in _CLIENT_FAULTS)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kept = ("allow", "www-authenticate")
        headers = {k: v for k, v in exc.headers.items() if k.lower() in kept}
        return error_response(exc.status, exc.text or exc.reason, headers)
    except (TemporaryFailure, StorageCorruption) as exc:
        # Local trouble: the client keeps what it sent and tries again (SMTP's 4xx).
        log.warning("%s %s: unavailable: %s", request.method, request.path, exc, extra=REPEATS)
        if isinstance(exc, Unavailable):  # the suppression list's file, not the queue
            text = f"{exc}; {exc.outcome}, try again once it is fixed"
        else:
            text = f"queue storage unavailable, try again later: {exc}"
        return error_response(503, text, {"Retry-After": RETRY_AFTER_S})
    except _CLIENT_TYPES as exc:
        status = next(code for kind, code in _CLIENT_FAULTS if isinstance(exc, kind))
        return error_response(status, str(exc))
    except Exception:
        # A bug of ours: a JSON answer all the same (clients parse one shape), the details
        # in the log only, never in the answer (they may name files or internals).
        log.exception("%s %s: unexpected error", request.method, request.path)
        return error_response(500, INTERNAL)
