"""The SASL mechanisms the receiver offers after STARTTLS: PLAIN and LOGIN.

Pure: no I/O.  ``SaslExchange`` is fed the client's decoded responses one at a time (the
first may be the AUTH command's initial response, RFC 4954 section 4) and answers either
a challenge to send (bytes, base64-encoded by the state machine) or the ``Credentials`` the
client presented.  Checking them is the caller's business (``auth.py``).

* PLAIN (RFC 4616 section 2): ``[authzid] NUL authcid NUL passwd`` in UTF-8, each part at
  most 255 octets, authcid and passwd not empty.  An empty initial challenge is sent when
  the client gave no initial response.
* LOGIN (draft-murchison-sasl-login): challenges ``Username:`` then ``Password:``; an
  initial response, when given, is the user name.  Obsolete but still what many clients
  (Outlook, older devices) use.

A malformed response raises ``SaslError`` with the reply to send (501 5.5.2); the SMTP
exchange is then over, as RFC 4954 section 4 has it for any failed exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from zoneq.protocol.replies import EnhancedStatus, Reply
from zoneq.protocol.smtp_server import AUTH_MECHANISMS

__all__ = ["MECHANISMS", "Credentials", "SaslError", "SaslExchange"]

MECHANISMS: Final = AUTH_MECHANISMS  # what EHLO offers
_MAX_PART: Final = 255  # RFC 4616 section 2: authzid, authcid and passwd up to 255 octets
MALFORMED: Final = Reply(501, ("Malformed authentication response",), EnhancedStatus(5, 5, 2))


class SaslError(Exception):
    """The client's SASL response is malformed; ``reply`` is the answer to send."""

    def __init__(self, reply: Reply = MALFORMED) -> None:
        super().__init__(str(reply))
        self.reply = reply


@dataclass(frozen=True, slots=True)
class Credentials:
    """What the client presented.  ``authzid`` is "" when it asked for no other identity.
    The password is left out of ``repr`` so that a log line can never show it."""

    username: str
    password: str = ""
    authzid: str = ""

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, authzid={self.authzid!r})"


def _text(part: bytes) -> str:
    if len(part) > _MAX_PART:
        raise SaslError()
    try:
        text = part.decode("utf-8")
    except UnicodeDecodeError:
        raise SaslError() from None
    if "\0" in text:
        raise SaslError()
    return text


class SaslExchange:
    """One AUTH exchange for ``mechanism`` (one of ``MECHANISMS``)."""

    def __init__(self, mechanism: str) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"unsupported SASL mechanism {mechanism!r}")
        self.mechanism = mechanism
        self._username: str | None = None

    def start(self, initial: bytes | None) -> bytes | Credentials:
        """The AUTH command arrived with ``initial`` (None: no initial response)."""
        if initial is None:
            return b"" if self.mechanism == "PLAIN" else b"Username:"
        return self.step(initial)

    def step(self, response: bytes) -> bytes | Credentials:
        """The client's next response: a challenge to send, or the credentials."""
        if self.mechanism == "PLAIN":
            return _plain(response)
        if self._username is None:
            self._username = _text(response)
            return b"Password:"
        return Credentials(self._username, _text(response))


def _plain(message: bytes) -> Credentials:
    parts = message.split(b"\0")
    if len(parts) != 3 or not parts[1] or not parts[2]:
        raise SaslError()
    authzid, authcid, passwd = (_text(part) for part in parts)
    return Credentials(authcid, passwd, authzid)
