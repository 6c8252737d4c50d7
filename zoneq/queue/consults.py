"""Many recipients of one message through the ``queue:route`` plugins, side by side, under
one deadline.

Asking the plugins about one recipient after another makes the wait the sum of their
answers: at the SMTP final dot, 1,000 recipients at 0.6 s each is ten minutes, when a client
waits at most ten minutes for the dot's reply (RFC 5321 section 4.5.3.2.6) and then retries,
sending a duplicate if the message was stored after all.  So the consults run concurrently,
at most ``CONCURRENCY`` at a time (a plugin's plain handlers have that many threads: more
would only queue for them), and the whole has one deadline, ``ROUTE_DEADLINE_S``, far enough
inside the client's ten minutes to leave time for the commit.  Past it the caller answers a
temporary failure (451 4.3.0 at the dot) and stores nothing: the client keeps the message
and tries again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

from zoneq.errors import TemporaryFailure
from zoneq.plugin import Drop, PluginFailure, Session
from zoneq.plugin.threads import THREADS_PER_PLUGIN
from zoneq.protocol.replies import Reply
from zoneq.queue.routing import Route, Router

__all__ = ["CONCURRENCY", "ROUTE_DEADLINE_S", "RoutingTooSlow", "consult_all"]

CONCURRENCY: Final = THREADS_PER_PLUGIN
ROUTE_DEADLINE_S: Final = 120.0
"""The longest all of one message's consults may take together: a fifth of the client's
ten minutes at the final dot (RFC 5321 section 4.5.3.2.6)."""

Verdict = Route | Reply | Drop


class RoutingTooSlow(TemporaryFailure):
    """The ``queue:route`` plugins did not answer for every recipient within the deadline.
    No single plugin hung past its own limit (that is a ``PluginFailure``); there were too
    many recipients for the time."""


async def consult_all(
    router: Router,
    asks: Sequence[tuple[str, Route]],
    *,
    sender: str,
    session: Session | None = None,
    deadline_s: float = ROUTE_DEADLINE_S,
) -> list[Verdict]:
    """``router.consult`` for each (recipient, decision) of ``asks``; the verdicts in order.

    Raises ``PluginFailure`` when a plugin misbehaves (the other consults are cancelled),
    ``RoutingTooSlow`` when the deadline passes first.
    """
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(recipient: str, decided: Route) -> Verdict:
        async with limit:
            return await router.consult(recipient, decided, sender=sender, session=session)

    try:
        async with asyncio.timeout(deadline_s):
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(rcpt, decided)) for rcpt, decided in asks]
    except TimeoutError:
        problem = f"{len(asks)} recipients not routed within {deadline_s:g}s"
        raise RoutingTooSlow(problem) from None
    except BaseExceptionGroup as failed:  # a TaskGroup's: flat, one per failed task
        first = failed.exceptions[0]
        if isinstance(first, PluginFailure):
            raise first from None  # one plugin's fault, as a single consult raises it
        raise
    return [task.result() for task in tasks]
