"""The fault suite (issue 7): ``zoneq serve`` as a real process under real faults.

Every scenario keeps a ledger of what got a 250 (``tests/support/ledger.py``) and checks
what reached the remote MX (Postfix's smtp-sink) afterwards: every acknowledged (message,
recipient) delivered or reported by a DSN, whole; extra copies only where the core logged a
possible duplicate (the RFC 1047 window) or, for a SIGKILL, what was in flight at the kill.

=====================  ==========================================================
``test_kills``         SIGKILL of the core while receiving, delivering and bouncing
``test_sigterm``       SIGTERM under load: out within 30 s, nothing lost on restart
``test_fsync``         fdatasync fails with EIO (strace ``inject``): 4xx, delivers, heals
``test_disk_full``     the queue's tmpfs fills up: 4xx, delivery goes on, heals alone
``test_remote_down``   connections refused, then accepted: resumes with no restart
``test_corruption``    a garbage record: quarantined, the rest delivered; one zoneq
``test_clock_jump``    +5 days while running and across a restart: one bounce each
``test_audit``         the verdict itself on made-up ledgers (no processes)
=====================  ==========================================================

The short profile runs in CI (``tools/dev test``): about 4 minutes on 2 busy cores.
``pytest --long`` (or ``ZONEQ_LONG_TESTS=1``; ``tests/conftest.py``) runs more kills, more
SIGTERM rounds and more fsync faults.  The full-disk test needs root (``mount``); strace,
faketime, dnsmasq and smtp-sink come with the test bed.  A scenario whose checks share one
run is a module fixture with one test per property, so a known bug is one ``xfail`` naming
it, not a scenario switched off.
"""
