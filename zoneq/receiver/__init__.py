"""The SMTP receiver: accepts mail from clients into the queue (``server.py``)."""

from zoneq.receiver.server import SmtpReceiver

__all__ = ["SmtpReceiver"]
