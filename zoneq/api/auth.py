"""Bearer-token authentication (RFC 6750) for every route but ``/health``.

The token is compared with ``hmac.compare_digest``, whose time does not depend on where the
first difference is, so a client cannot find the token a character at a time by timing
refusals.  A refusal is 401 with ``WWW-Authenticate: Bearer`` (RFC 6750 section 3), plus
``error="invalid_token"`` when a token was sent but was wrong.
"""

from __future__ import annotations

import hmac
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from zoneq.api.errors import error_response

PUBLIC: Final = frozenset({"/health"})
REALM: Final = 'Bearer realm="zoneq"'


def bearer_auth(token: str) -> Middleware:
    expected = token.encode()

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC:
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return error_response(401, "a bearer token is required", {"WWW-Authenticate": REALM})
        if not hmac.compare_digest(given.strip().encode("utf-8", "replace"), expected):
            challenge = REALM + ', error="invalid_token"'
            return error_response(401, "invalid token", {"WWW-Authenticate": challenge})
        return await handler(request)

    return authenticate
