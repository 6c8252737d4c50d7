"""One place where failures become HTTP answers: JSON bodies, the right status for whose
fault it was.

* the client's: 400 (bad input, named), 404 (no such message, zone or route), 405, 409 (the
  operation does not apply to the message's state now, or the suppression plugin that
  would consult a list is not enabled), 413 (over the size limit);
* ours, local and temporary (storage refusing writes, the free-space floor, a suppression
  list file that cannot be read or written): 503 with
  ``Retry-After``, never 500, the HTTP form of SMTP's 4xx: nothing was stored, try again.
"""

from __future__ import annotations

import logging
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import ValidationError

from zoneq.api.suppression_list import Unavailable
from zoneq.errors import NotFound, StorageCorruption, TemporaryFailure
from zoneq.logs import REPEATS
from zoneq.queue.intake import TooLarge, Unacceptable

log = logging.getLogger("zoneq.api")

RETRY_AFTER_S: Final = "30"


class Conflict(Exception):
    """The operation does not apply to what the message is now (say, nothing held)."""


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


# Whose fault, by exception type; first match wins (pydantic's ValidationError is a
# ValueError, so it comes first for its better message).
_CLIENT_FAULTS: Final[tuple[tuple[type[Exception], int], ...]] = (
    (NotFound, 404),
    (Unacceptable, 400),
    (ValueError, 400),
    (TooLarge, 413),
    (Conflict, 409),
)


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
    except ValidationError as exc:
        return error_response(400, _validation_text(exc))
    except (TemporaryFailure, StorageCorruption) as exc:
        # Local trouble: the client keeps what it sent and tries again (SMTP's 4xx).
        log.warning("%s %s: unavailable: %s", request.method, request.path, exc, extra=REPEATS)
        if isinstance(exc, Unavailable):  # the suppression list's file, not the queue
            text = f"{exc}; nothing was changed, try again once it is fixed"
        else:
            text = f"queue storage unavailable, try again later: {exc}"
        return error_response(503, text, {"Retry-After": RETRY_AFTER_S})
    except (NotFound, Unacceptable, ValueError, TooLarge, Conflict) as exc:
        status = next(code for kind, code in _CLIENT_FAULTS if isinstance(exc, kind))
        return error_response(status, str(exc))
