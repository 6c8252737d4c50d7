"""The SMTP receiver: accepts mail from clients into the queue (``server.py``)."""

from zoneq.receiver.server import SmtpReceiver, route

__all__ = ["SmtpReceiver", "route"]
