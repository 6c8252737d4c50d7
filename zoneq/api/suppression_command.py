"""``zoneq suppression list|add|remove|check ZONE [ADDRESS...]``: the suppression list from
the shell, through the API like ``zoneq queue``.

A command of its own rather than under ``zoneq queue``: the list is not the queue, it says
who must never be mailed.  ``ZONE`` is a zone name or ``"*"`` (quote it in the shell) for
the list every zone consults.  Tables for people, ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

from zoneq.api.client import ApiClient, quoted_path
from zoneq.api.command import V1, Result, UsageError, connection_options, run_action, table

BATCH: Final = 10_000  # addresses per add request: one journal line (and fsync) each
PAGE: Final = 1000  # the API's largest page


def _path(zone: str) -> str:
    return V1 + quoted_path("suppression", zone)  # a zone name is one segment, whatever it holds


def _addresses(args: argparse.Namespace) -> list[str]:
    """ADDRESS arguments, then the lines of --file (``-``: standard input), blanks and
    ``#`` comments skipped."""
    found = list(args.addresses)
    if args.file is not None:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            try:
                lines = Path(args.file).read_text(encoding="utf-8").splitlines()
            except OSError as exc:
                raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None
        found.extend(s for line in lines if (s := line.strip()) and not s.startswith("#"))
    if not found:
        raise UsageError("give at least one address (or --file)")
    return found


def _pages(api: ApiClient, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    cursor = args.cursor
    while True:
        query = [("limit", str(args.limit))] + ([("cursor", cursor)] if cursor else [])
        body: dict[str, Any] = api.call("GET", _path(args.zone), query=query)
        yield body
        cursor = body["cursor"]
        if not (args.all and cursor):
            return


def _list(api: ApiClient, args: argparse.Namespace) -> Result:
    pages = list(_pages(api, args))
    addresses = [a for page in pages for a in page["addresses"]]
    last = pages[-1]
    body = {**last, "addresses": addresses}
    lines = [*addresses, f"{len(addresses)} of {last['total']} address(es) in {args.zone}"]
    if last["cursor"]:
        lines.append(f"more: --cursor {last['cursor']} (or --all)")
    return body, "\n".join(lines)


def _add(api: ApiClient, args: argparse.Namespace) -> Result:
    addresses = _addresses(args)
    added, total = 0, 0
    for start in range(0, len(addresses), BATCH):
        chunk = addresses[start : start + BATCH]
        answer = api.call("POST", _path(args.zone), json_body={"addresses": chunk})
        added, total = added + answer["added"], answer["total"]
    body = {"zone": args.zone, "added": added, "total": total}
    return body, f"added {added} address(es) to {args.zone} ({total} listed)"


def _remove(api: ApiClient, args: argparse.Namespace) -> Result:
    removed = [
        api.call("DELETE", _path(args.zone), query=[("address", address)])
        for address in _addresses(args)
    ]
    return removed, "\n".join(f"removed {r['address']} from {r['zone']}" for r in removed)


def _check(api: ApiClient, args: argparse.Namespace) -> Result:
    answers = [
        api.call("GET", f"{_path(args.zone)}/check", query=[("address", address)])
        for address in _addresses(args)
    ]
    rows = [
        [a["address"], "suppressed" if a["suppressed"] else "-", ", ".join(a["lists"])]
        for a in answers
    ]
    return answers, table(rows, ["address", f"in {args.zone}", "lists"])


def register(sub: Any) -> None:
    """Add ``suppression`` to the ``zoneq`` command's subparsers."""
    common = connection_options()
    top = sub.add_parser(
        "suppression", help="addresses that must not be mailed, per zone (through the API)"
    )
    actions = top.add_subparsers(dest="action", required=True)

    def add(name: str, text: str, action: Callable[[ApiClient, argparse.Namespace], Result]) -> Any:
        parser = actions.add_parser(name, help=text, parents=[common])
        parser.add_argument("zone", help='a zone name, or "*" for every zone')
        parser.set_defaults(func=run_action(action))
        return parser

    listing = add("list", "a zone's suppressed addresses, sorted, a page at a time", _list)
    listing.add_argument("--limit", type=int, default=PAGE, help=f"page size, 1 to {PAGE}")
    listing.add_argument("--cursor", default=None, help="from the previous page")
    listing.add_argument("--all", action="store_true", help="every page, to the end")
    for parser in (
        add("add", "suppress addresses in the zone", _add),
        add("remove", "take addresses off the zone's list", _remove),
        add("check", "whether mail to the addresses is suppressed in the zone", _check),
    ):
        parser.add_argument("addresses", nargs="*", metavar="ADDRESS")
        parser.add_argument("--file", default=None, help="one address a line (- for stdin)")
