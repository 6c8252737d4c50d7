"""A real queue with real events: messages committed to a LevelDB store on disk and taken
through the store's lifecycle (lease, complete, defer, bounce, drop), as the queue service
would.  The export and analytics tests read what this writes; nothing about the events is
made up by hand.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

from tests.storage.conftest import (  # noqa: F401  (stores: the storage tests' fixture)
    MINUTE,
    T0,
    queue_message,
    stores,
)
from zoneq.protocol.provider_replies import PROVIDER_RULES
from zoneq.protocol.reply_rules import rule_report
from zoneq.storage.base import Outcome
from zoneq.storage.store import QueueStore

# Zone names with the characters a path or a key must survive (space, slash, '=', UTF-8).
ZONES = ("bulk", "transactional", "eu west/2=a", "zöne")
# domain -> (outcome on the first attempt, on later ones)
DOMAINS = {
    "ok.test": ("delivered", "delivered"),
    "slow.test": ("deferred", "delivered"),
    "bad.test": ("bounced", "bounced"),
    "down.test": ("deferred", "deferred"),
    "Mixed.Test": ("deferred", "bounced"),
}
MX = {
    "ok.test": "mx1.ok.test",
    "slow.test": "mx.slow.test",
    "bad.test": "mx.bad.test",
    "down.test": None,
    "mixed.test": "mx.mixed.test",
}
HOUR = 60 * MINUTE
SOURCES = ("127.0.0.21", "127.0.0.22", None)
REPLIES = {
    "delivered": (250, "2.0.0", "250 2.0.0 Ok: queued"),
    "deferred": (451, "4.3.0", "451 4.3.0 Try again later"),
    "deferred-alt": (421, "4.7.0", "421 4.7.0 Too many connections"),
    "deferred-listed": (
        554,
        "5.7.1",
        "554 5.7.1 Service unavailable; Client host [127.0.0.21] blocked using zen.spamhaus.org",
    ),
    "bounced": (550, "5.1.1", "550 5.1.1 No such user"),
    "bounced-alt": (554, "5.7.1", "554 5.7.1 Rejected by policy"),
}


@dataclass
class Traffic:
    """Drives a store through a day of traffic, one step at a time."""

    store: QueueStore
    rng: random.Random = field(default_factory=lambda: random.Random(6))
    now: int = T0
    messages: list[int] = field(default_factory=list)

    async def send(self, count: int) -> None:
        """Commit ``count`` messages of 1-4 recipients each, a few minutes apart."""
        for _ in range(count):
            self.now += self.rng.randrange(1, 9) * MINUTE
            zone = self.rng.choice(ZONES)
            recipients = [
                (f"user{self.rng.randrange(1000)}@{self.rng.choice(list(DOMAINS))}", zone)
                for _ in range(self.rng.randrange(1, 5))
            ]
            body = (b"Subject: t\r\n\r\n", b"x" * self.rng.randrange(10, 3000) + b"\r\n")
            msg_id = await queue_message(self.store, recipients, now_ms=self.now, body=body)
            self.messages.append(msg_id)

    async def deliver(self) -> int:
        """One delivery round over every zone: promote what is due, lease all, report."""
        done = 0
        self.now += self.rng.randrange(1, 30) * MINUTE
        for zone in ZONES:
            await self.store.promote_due(zone, self.now)
            for lease in self.store.lease(zone, 10_000, "test-worker"):
                record = lease.recipient
                first, later = DOMAINS[_case(record.domain)]
                result = first if record.attempts == 0 else later
                self.now += self.rng.randrange(0, 3000)
                size = self.store.message(record.msg_id).size
                variant = self.rng.random() < 0.3
                key = f"{result}-alt" if variant and result != "delivered" else result
                if key == "deferred-alt" and self.rng.random() < 0.5:
                    key = "deferred-listed"
                code, enhanced, reply = REPLIES[key]
                # the category as the core decides it (queue/service.py, _judged)
                category = None
                if result != "delivered":
                    category = rule_report(PROVIDER_RULES, code, enhanced, reply).category
                outcome = Outcome(
                    reply=reply,
                    code=code,
                    enhanced=enhanced,
                    mx=MX[record.domain],
                    source_ip=self.rng.choice(SOURCES),
                    size=size,
                    category=category,
                )
                if result == "delivered":
                    await self.store.complete(lease, self.now, outcome)
                elif result == "deferred":
                    give_up = record.attempts >= 3
                    if give_up:
                        await self.store.bounce(lease, self.now, outcome, expired=True)
                    else:
                        retry = self.now + self.rng.randrange(5, 60) * MINUTE
                        await self.store.defer(lease, self.now, retry, outcome)
                else:
                    await self.store.bounce(lease, self.now, outcome)
                done += 1
        await self.store.drain()
        return done

    async def drop_one(self) -> None:
        """An administrator drops one message that is still queued, if any."""
        for msg_id in self.messages:
            try:
                if self.store.recipients(msg_id):
                    await self.store.drop(msg_id, self.now)
                    return
            except Exception:
                continue

    async def day(self, messages: int = 60, rounds: int = 8) -> None:
        """A mixed run: messages arrive between delivery rounds spread over ~a day."""
        per_round = max(1, messages // rounds)
        for _ in range(rounds):
            await self.send(per_round)
            await self.deliver()
            self.now += HOUR
        await self.drop_one()
        await self.store.drain()


def _case(domain: str) -> str:
    """DOMAINS is keyed as the sender typed it; the store lowercases (RFC 5321 2.4)."""
    for name in DOMAINS:
        if name.lower() == domain:
            return name
    raise KeyError(domain)


def stopped_directory(path: Path, messages: int = 20, rounds: int = 2) -> Path:
    """A data directory after a day of traffic, closed (zoneq stopped): ``path``."""

    async def fill() -> None:
        store = QueueStore.open(path)
        store.recover()
        await Traffic(store).day(messages=messages, rounds=rounds)
        await store.close()

    asyncio.run(fill())
    return path
