"""``zoneq hash-password``: make a ``receiver.auth_users`` value from a password.

The password is read from the terminal (asked twice) or, when standard input is not a
terminal, as its first line, so that scripts can pipe it in.  It is never taken from the
command line, where ``ps`` and shell histories would show it.  The hash is printed alone
on standard output, ready to paste into ``[receiver.auth_users]``.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from zoneq.receiver.passwords import hash_password

__all__ = ["register"]


def _read_password() -> str | None:
    if sys.stdin.isatty():
        first = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != first:
            print("zoneq hash-password: the passwords differ", file=sys.stderr)
            return None
        return first
    return sys.stdin.readline().removesuffix("\n").removesuffix("\r")


def _run(args: argparse.Namespace) -> int:
    password = _read_password()
    if password is None:
        return 1
    if not password:
        print("zoneq hash-password: empty password", file=sys.stderr)
        return 1
    print(hash_password(password))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``hash-password`` subcommand to ``zoneq``'s parser."""
    command = sub.add_parser(
        "hash-password",
        help="hash a password (read from the terminal or stdin) for receiver.auth_users",
    )
    command.set_defaults(func=_run)
