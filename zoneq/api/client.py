"""A small blocking HTTP client for the API, used by ``zoneq queue`` and ``zoneq send``.

The standard library's ``http.client`` is enough: one request at a time, a file uploaded
in blocks (never read whole: with its Content-Length, or chunked when it has none, as a
pipe), a source written to a file as it arrives.  Errors come back as ``ApiError``
carrying the API's status, message and JSON body (status 0: no HTTP answer at all), or as
``InvalidRequest`` when the caller's input cannot be put into an HTTP request; nothing else
escapes for bad input.

Every variable part of a path goes through ``quoted_path``: percent-encoded whole, so a zone, a
message id or a U-label domain is one segment however it is spelt (``bücher.example``,
``no such zone``, ``../zones/default``), as the API's router decodes it.
"""

from __future__ import annotations

import http.client
import json
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import IO, Any, Final
from urllib.parse import quote, urlencode

BLOCK: Final = 65_536
TIMEOUT_S: Final = 300.0  # a purge of millions of recipients takes a while


# Segments that RFC 3986 section 5.2.4 removes or merges while normalizing a path, so they
# would reach another resource than the one named: refused rather than sent.
_NOT_A_SEGMENT: Final = frozenset({"", ".", ".."})


class ApiError(Exception):
    """The API refused (its status, message and JSON error body) or gave no usable answer
    (status 0, body None)."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body

    def json(self) -> Any:
        """The API's JSON error body as it came; without one, the same shape made here."""
        if self.body is not None:
            return self.body
        return {"error": {"status": self.status, "message": self.message}}


class InvalidRequest(ValueError):
    """The caller's input cannot be sent as an HTTP request (an empty or dot path segment,
    a token HTTP cannot carry, an unusable host name); nothing was sent."""


def quoted_path(*segments: str) -> str:
    """``/seg/seg...``, each segment percent-encoded whole (RFC 3986 section 3.3: UTF-8,
    and "/", "?", "#", "%" and spaces encoded too), so it cannot split or end the path."""
    for segment in segments:
        if segment in _NOT_A_SEGMENT:
            raise InvalidRequest(f"{segment!r} cannot name a zone, a message or a domain")
    return "".join("/" + quote(segment, safe="") for segment in segments)


class ApiClient:
    def __init__(self, host: str, port: int, token: str, *, timeout: float = TIMEOUT_S) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.timeout = timeout

    def _send(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None,
        body: bytes | IO[bytes] | None,
        headers: dict[str, str],
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        target = path + ("?" + urlencode(query) if query else "")
        # As it was given: an IPv6 host in brackets (RFC 3986 section 3.2.2), else "::1:80".
        host = f"[{self.host}]" if ":" in self.host else self.host
        where = f"{host}:{self.port}"
        try:
            connection = http.client.HTTPConnection(
                self.host, self.port, timeout=self.timeout, blocksize=BLOCK
            )
        except http.client.InvalidURL as exc:  # a host with a space or a control character
            raise InvalidRequest(f"cannot send a request to {where}: {exc}") from exc
        try:
            connection.request(
                method,
                target,
                body=body,
                headers={"Authorization": f"Bearer {self.token}", **headers},
            )
            response = connection.getresponse()
        except http.client.InvalidURL as exc:  # a path http.client will not send
            connection.close()
            raise InvalidRequest(f"cannot send a request to {where}: {exc}") from exc
        except (OSError, http.client.HTTPException) as exc:  # refused, timed out, not HTTP
            connection.close()
            raise ApiError(0, f"cannot reach the API at {where}: {exc}") from exc
        except ValueError as exc:
            # Refused before sending: a header value outside Latin-1 or with a control
            # character (RFC 9110 section 5.5), a host name the idna codec cannot encode.
            connection.close()
            raise InvalidRequest(f"cannot send a request to {where}: {exc}") from exc
        if response.status >= 400:
            text = response.read()
            connection.close()
            raise ApiError(response.status, *_error(text, response.reason))
        return connection, response

    def call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        json_body: Any = None,
    ) -> Any:
        """One request with an optional JSON body; the decoded JSON answer."""
        body = None if json_body is None else json.dumps(json_body).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection, response = self._send(method, path, query, body, headers)
        try:
            return json.loads(response.read() or b"null")
        finally:
            connection.close()

    def download(self, path: str, sink: Callable[[], AbstractContextManager[IO[bytes]]]) -> None:
        """GET ``path`` into the file ``sink()`` opens, which is opened only once the API
        has answered 200: a refusal (an unknown id, a bad token) or no answer at all
        leaves the caller's file as it was.  An OSError of ``sink()`` itself (the file
        cannot be opened) is the caller's to report; one while copying is a broken
        download (``ApiError``), ended by leaving ``sink``'s context with it."""
        connection, response = self._send("GET", path, None, None, {})
        try:
            with sink() as out:
                _copy_whole(response, out)
        finally:
            connection.close()

    def upload(
        self, path: str, source: IO[bytes], size: int | None, query: list[tuple[str, str]]
    ) -> Any:
        """POST ``source`` as the body, streamed in blocks, never read whole: with its
        Content-Length when ``size`` is known (the API refuses a message over its size
        limit on that header alone), else chunked (RFC 9112 section 7.1: http.client
        does so for a file body without a length), the limit applied as the API reads."""
        headers = {"Content-Type": "message/rfc822"}
        if size is not None:
            headers["Content-Length"] = str(size)
        connection, response = self._send("POST", path, query, source, headers)
        try:
            return json.loads(response.read())
        finally:
            connection.close()


def _copy_whole(response: http.client.HTTPResponse, out: IO[bytes]) -> None:
    try:
        shutil.copyfileobj(response, out, BLOCK)
        # read(amount) of a length-delimited answer returns short at a closed
        # connection instead of raising (chunked answers raise IncompleteRead).
        if response.length:
            raise http.client.IncompleteRead(b"", response.length)
    except (OSError, http.client.HTTPException) as exc:
        # The answer broke off (the server could not read the rest, or the connection
        # went), or the file could not take it: what was written is not the whole message.
        raise ApiError(0, f"the download broke off: {exc!r}") from None


def _error(text: bytes, reason: str) -> tuple[str, Any]:
    """An error answer's message and its JSON body (None if it is not JSON)."""
    try:
        body = json.loads(text)
    except ValueError:
        return reason, None
    try:
        return str(body["error"]["message"]), body
    except (KeyError, TypeError):
        return reason, body
