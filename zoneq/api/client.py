"""A small blocking HTTP client for the API, used by ``zoneq queue`` and ``zoneq send``.

The standard library's ``http.client`` is enough: one request at a time, a file uploaded
from disk in blocks with its Content-Length (never read whole), a source written to a file
as it arrives.  Errors come back as ``ApiError`` carrying the API's status and message.
"""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path
from typing import IO, Any, Final
from urllib.parse import urlencode

BLOCK: Final = 65_536
TIMEOUT_S: Final = 300.0  # a purge of millions of recipients takes a while


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


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
        connection = http.client.HTTPConnection(
            self.host, self.port, timeout=self.timeout, blocksize=BLOCK
        )
        try:
            connection.request(
                method,
                target,
                body=body,
                headers={"Authorization": f"Bearer {self.token}", **headers},
            )
            response = connection.getresponse()
        except OSError as exc:
            connection.close()
            raise ApiError(0, f"cannot reach the API at {self.host}:{self.port}: {exc}") from exc
        if response.status >= 400:
            text = response.read()
            connection.close()
            raise ApiError(response.status, _message(text, response.reason))
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

    def download(self, path: str, out: IO[bytes]) -> None:
        connection, response = self._send("GET", path, None, None, {})
        try:
            shutil.copyfileobj(response, out, BLOCK)
        finally:
            connection.close()

    def upload(self, path: str, source: Path, query: list[tuple[str, str]]) -> Any:
        """POST a file as the body, streamed from disk with its Content-Length."""
        with source.open("rb") as data:
            headers = {
                "Content-Type": "message/rfc822",
                "Content-Length": str(source.stat().st_size),
            }
            connection, response = self._send("POST", path, query, data, headers)
        try:
            return json.loads(response.read())
        finally:
            connection.close()


def _message(text: bytes, reason: str) -> str:
    try:
        body = json.loads(text)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reason
