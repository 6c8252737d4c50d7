"""The SMTP client side; aiosmtplib is imported only in here (``dialogue.py``).

``deliver`` runs one message to one host and returns a result per recipient;
``ConnectionCache`` keeps connections for the next message to the same host.
"""

from zoneq.delivery.transport.cache import Connection, ConnectionCache
from zoneq.delivery.transport.options import (
    RFC5321_TIMEOUTS,
    BodySource,
    MailOptions,
    Recipient,
    Timeouts,
    TlsPolicy,
)
from zoneq.delivery.transport.session import deliver

__all__ = [
    "RFC5321_TIMEOUTS",
    "BodySource",
    "Connection",
    "ConnectionCache",
    "MailOptions",
    "Recipient",
    "Timeouts",
    "TlsPolicy",
    "deliver",
]
