"""SMTP AUTH for the receiver (RFC 4954): the user store and one session's exchanges.

Users and their password hashes come from ``receiver.auth_users`` (``passwords.py`` for the
hash format).  The state machine offers AUTH only once TLS is active (RFC 4954 section 4
leaves that to policy; sending a password in clear text is never right) and answers 538
5.7.11 to AUTH before STARTTLS.  Here:

* A check runs scrypt in a worker thread, so a 50 ms hash never stalls other sessions; an
  unknown user is checked against a dummy hash, so the answer takes as long either way.
  The threads are the authenticator's own, not the loop's shared default executor, so
  nothing else that fills that pool (a plugin's hung handler, once) can hold up AUTH.
* A failed check answers 535 5.7.8 (RFC 4954 section 6) only after ``FAILURE_DELAY_S``,
  which slows down guessing; after ``MAX_FAILURES`` in one session the client gets 421
  and the connection is closed (as Postfix's ``smtpd_hard_error_limit`` would).
* An authorization identity other than the user (RFC 4616 section 2) is refused: zoneq
  does not let one user act as another.
* A plugin at ``smtp:auth`` (issue 5) may decide first; when it has no opinion the
  configured users do.
* Passwords are never logged; the user name is, and is stored with each message the
  session sends (``MessageMeta.source["auth"]``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from zoneq.protocol.replies import EnhancedStatus, Reply
from zoneq.receiver.passwords import dummy_hash, verify_password
from zoneq.receiver.sasl import Credentials, SaslError, SaslExchange

__all__ = ["AUTH_FAILED", "AuthSession", "Authenticator", "Outcome", "PluginVerdict"]

log = logging.getLogger("zoneq.receiver")

FAILURE_DELAY_S: Final = 1.0
MAX_FAILURES: Final = 3
HASH_THREADS: Final = 2
"""scrypt is CPU work (and releases the GIL): more threads than cores gains nothing."""
AUTH_OK: Final = Reply(235, ("Authentication successful",), EnhancedStatus(2, 7, 0))
AUTH_FAILED: Final = Reply(535, ("Authentication credentials invalid",), EnhancedStatus(5, 7, 8))


def too_many_failures(hostname: str) -> Reply:
    """421 4.7.0 naming this host, as every 421 does (RFC 5321 section 4.2.3: "421
    <domain> Service not available, closing transmission channel")."""
    text = f"{hostname} Too many authentication failures, closing"
    return Reply(421, (text,), EnhancedStatus(4, 7, 0))


class Authenticator:
    """Checks credentials against the configured users (name -> scrypt hash)."""

    def __init__(
        self, users: Mapping[str, str], *, failure_delay_s: float = FAILURE_DELAY_S
    ) -> None:
        self._users = dict(users)
        self.failure_delay_s = failure_delay_s
        # Threads start at the first check; none while AUTH is unused.
        self._hashing = concurrent.futures.ThreadPoolExecutor(
            max_workers=HASH_THREADS, thread_name_prefix="auth-scrypt"
        )
        if self._users:
            # Made now, off the loop, so the first unknown user's answer takes no longer
            # than a known user's (one scrypt each).
            self._hashing.submit(dummy_hash)

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    async def check(self, credentials: Credentials) -> bool:
        """True when the credentials are right; a wrong answer comes after the delay."""
        stored = self._users.get(credentials.username)
        loop = asyncio.get_running_loop()
        matched = await loop.run_in_executor(self._hashing, _verify, stored, credentials.password)
        ok = matched and stored is not None and credentials.authzid in ("", credentials.username)
        if not ok:
            await asyncio.sleep(self.failure_delay_s)
        return ok


def _verify(stored: str | None, password: str) -> bool:
    # On the hashing thread, the dummy hash too: the first unknown user's check makes it
    # (a scrypt), and it must neither stall the loop nor take longer than a known user's.
    return verify_password(stored or dummy_hash(), password)


Outcome = bytes | Reply
"""What to do with a pending AUTH event: a challenge to send (bytes), or the final reply
(235 accepts; anything else rejects)."""


PluginVerdict = Callable[[str, Credentials], Awaitable[bool | Reply | None]]
"""The ``smtp:auth`` plugins' say on (mechanism, credentials): True accepts, False refuses,
a reply is answered as it is, None leaves it to the configured users (``hooks.py``)."""


class AuthSession:
    """The AUTH state of one SMTP session: the exchange in progress and the result."""

    def __init__(
        self,
        authenticator: Authenticator,
        peer: str,
        plugins: PluginVerdict | None = None,
        *,
        hostname: str,
    ) -> None:
        self._authenticator = authenticator
        self._peer = peer
        self._hostname = hostname
        self._plugins = plugins
        self._mechanism = ""
        self._exchange: SaslExchange | None = None
        self.failures = 0
        self.user: str | None = None

    async def request(self, mechanism: str, initial: bytes | None) -> Outcome:
        """AUTH ``mechanism`` [initial response]."""
        self._mechanism = mechanism
        self._exchange = SaslExchange(mechanism)
        try:
            step = self._exchange.start(initial)
        except SaslError as exc:
            return self._malformed(exc)
        return await self._settle(step)

    async def response(self, data: bytes) -> Outcome:
        """The client's answer to our last challenge."""
        if self._exchange is None:
            raise RuntimeError("AUTH response without an exchange in progress")
        try:
            step = self._exchange.step(data)
        except SaslError as exc:
            return self._malformed(exc)
        return await self._settle(step)

    def _malformed(self, exc: SaslError) -> Reply:
        self._exchange = None
        return exc.reply

    async def _settle(self, step: bytes | Credentials) -> Outcome:
        if isinstance(step, bytes):
            return step
        self._exchange = None
        verdict = await self._verdict(step)
        if isinstance(verdict, Reply):
            # The plugin's own answer (or 451 4.3.0 for a failing plugin): not counted as
            # a wrong password, which is the plugin's to say with False.
            log.warning(
                "%s: AUTH for %r answered by a plugin: %s", self._peer, step.username, verdict
            )
            return verdict
        if verdict:
            self.user = step.username
            log.info("%s: authenticated as %r", self._peer, step.username)
            return AUTH_OK
        self.failures += 1
        log.warning("%s: authentication failed for %r", self._peer, step.username)
        if self.failures >= MAX_FAILURES:
            return too_many_failures(self._hostname)
        return AUTH_FAILED

    async def _verdict(self, credentials: Credentials) -> bool | Reply:
        """A plugin's verdict if one has an opinion, else the configured users'.  A plugin's
        False is delayed like a wrong password, so guessing is as slow either way."""
        if self._plugins is not None:
            decided = await self._plugins(self._mechanism, credentials)
            if decided is False:
                await asyncio.sleep(self._authenticator.failure_delay_s)
            if decided is not None:
                return decided
        return await self._authenticator.check(credentials)
