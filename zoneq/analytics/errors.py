"""The one error the analytics job raises on purpose: what went wrong, in one message."""

from __future__ import annotations


class AnalyticsError(Exception):
    """The job cannot run or finish (no Java, a bad input, another schema version, ...).

    The message is meant for the operator as it is: no JVM stack trace behind it.
    """
