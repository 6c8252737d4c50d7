"""``zoneq queue ...`` and ``zoneq send FILE``: the API's operations from the shell.

Like Postfix's ``postqueue -p`` / ``postsuper``: tables for people, ``--json`` for scripts
(the API's own JSON, unchanged).  The API's address and token come from the config
(``api.listen``; ``api.token``, ``api.token_file`` or the generated ``api.token`` in the data
directory), overridden by ``ZONEQ_API`` / ``ZONEQ_API_TOKEN`` and then by ``--api`` /
``--token``.  Exit status: 0 done, 1 the API refused or could not be reached, 2 bad usage or
configuration.  With ``--json`` a failure of the API's (status 1) prints the API's JSON error
body on stdout as well, or ``{"error": {"status": 0, "message": ...}}`` in the same shape
when there was no answer, so a script always has JSON to parse; the line on stderr stays.

Tables are sized by display width (``wcwidth``): a CJK character takes two terminal columns
and a combining mark none, so ``len`` would misalign every column after such a cell.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Final

import wcwidth

from zoneq.api.client import ApiClient, ApiError, InvalidRequest, quoted_path
from zoneq.api.token import find_token
from zoneq.config import load_config
from zoneq.config.model import split_listen
from zoneq.errors import ConfigError

ENV_API: Final = "ZONEQ_API"
ENV_TOKEN: Final = "ZONEQ_API_TOKEN"
V1: Final = "/api/v1"
STATES: Final = ("ready", "leased", "deferred", "held")


class UsageError(Exception):
    pass


def client_from(args: argparse.Namespace) -> ApiClient:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        raise UsageError(f"configuration error:\n{exc}") from exc
    given = args.api or os.environ.get(ENV_API)
    if not given and not config.api.enabled:
        # Before the token: serve makes none with the API off, so "no API token ... start
        # zoneq serve" would send the user to a serve that is already running.
        raise UsageError(
            f"the HTTP API is disabled ([api] enabled = false); these commands need it "
            f"(or another zoneq's: --api / {ENV_API})"
        )
    listen = given or config.api.listen
    try:
        host, port = split_listen(listen)
    except ValueError as exc:
        raise UsageError(f"--api / {ENV_API}: {exc}") from exc
    if host in ("0.0.0.0", "::"):  # the API listens everywhere: talk to it on loopback
        host = "127.0.0.1"
    try:
        token = args.token or os.environ.get(ENV_TOKEN) or find_token(config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    if not token:
        raise UsageError(
            "no API token: set api.token in the config, or start zoneq serve once to "
            f"generate one, or pass --token / {ENV_TOKEN}"
        )
    return ApiClient(host, port, token)


def printable(value: object) -> str:
    """``value`` as text with every non-printable character escaped (``\\x1b``, ``\\r``,
    ``\\u2028``): C0 and C1 controls, DEL, the line separators, the bidi controls.

    Subjects, addresses, replies and hold reasons are senders' and remote servers' text:
    printed as they are, an ESC sequence in a Subject would drive the operator's terminal
    (retitle it, clear it, hide lines) and a CR or LF would forge table rows."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [list(map(printable, header))] + [[printable(c) for c in row] for row in rows]
    widths = [max(wcwidth.width(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(wcwidth.ljust(c, w) for c, w in zip(row, widths, strict=True)) for row in cells
    ]
    return "\n".join(line.rstrip() for line in lines)


def _when(ms: int) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


# --- what each subcommand does: (client, args) -> (JSON answer, text for people) ---------


Result = tuple[Any, str]


def _counts(api: ApiClient, args: argparse.Namespace) -> Result:
    body = api.call("GET", f"{V1}/queue")
    rows = [
        [zone, *(c[s] for s in STATES), "paused" if c["paused"] else ""]
        for zone, c in sorted(body["zones"].items())
    ]
    text = table(rows, ["zone", *STATES, ""]) + f"\n{body['messages']} message(s) queued"
    return body, text


def _recipient_rows(recipients: list[dict[str, Any]]) -> str:
    rows = [
        [
            r["message_id"],
            r["address"],
            r["state"],
            r["attempts"],
            _when(r["next_attempt_ms"]),
            # Why it is held is what the operator must see before releasing it; a held
            # recipient's last reply is history (its JSON keeps both).
            r["hold_reason"] if r["state"] == "held" else r["last_reply"],
        ]
        for r in recipients
    ]
    header = ["message", "recipient", "state", "tries", "next attempt", "last reply / hold reason"]
    return table(rows, header)


def _filter(value: str | None, option: str) -> str | None:
    """An optional filter as given: None when left out, refused when empty.  An empty value
    (a script's variable that came out empty) would otherwise read as left out and widen
    the operation: a recipient's delete to the whole message, a zone's retry to every zone."""
    if value is not None and not value.strip():
        raise UsageError(f"{option}: must not be empty: leave the option out to match any")
    return value


def _browse(api: ApiClient, args: argparse.Namespace) -> Result:
    query = [("state", args.state), ("limit", str(args.limit))]
    if _filter(args.cursor, "--cursor") is not None:
        query.append(("cursor", args.cursor))
    body = api.call("GET", V1 + quoted_path("zones", args.zone, "recipients"), query=query)
    text = _recipient_rows(body["recipients"])
    if body["cursor"]:
        text += f"\nmore: --cursor {body['cursor']}"
    return body, text


def _show(api: ApiClient, args: argparse.Namespace) -> Result:
    body = api.call("GET", V1 + quoted_path("messages", args.id))
    lines = [
        f"message   {body['id']}",
        f"sender    <{printable(body['sender'])}>",
        f"received  {_when(body['received_ms'])}",
        f"size      {body['size']}",
        f"zones     {printable(', '.join(body['zones']))}",
        *(f"{printable(name):<9} {printable(value)}" for name, value in body["headers"].items()),
        "",
        _recipient_rows(body["recipients"]),
    ]
    return body, "\n".join(lines)


@contextlib.contextmanager
def _replacing(target: Path) -> Iterator[IO[bytes]]:
    """A file for the whole of a download to ``target``, opened once the API has said yes.

    A new file, or a regular file of ours that a new one could stand in for (``_renamable``),
    is written beside ``target`` under a temporary name and renamed over it (atomic on
    POSIX) only when the whole message is there: a part of a message must not pass for
    one, and a failed download leaves what was there before.  Anything else is written in
    place, as the shell's ``> FILE`` would: a file in a folder we cannot write, another
    user's or a write-protected file (opened only if we may write it: refused otherwise,
    as ``>`` is), one with hard links, ``/dev/null``, a FIFO.  Nothing is ever removed or
    renamed over there: the command removes nothing it did not create."""
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory")
    final = target.resolve()  # through a symlink: the link stays, its file is replaced
    if not _renamable(final):
        with _in_place(target) as out:
            yield out
        return
    mode = final.stat().st_mode & 0o7777 if final.exists() else _new_file_mode()
    fd, temporary = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
        os.chmod(temporary, mode)  # mkstemp's 0600, not what a plain open would have made
        os.replace(temporary, final)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _renamable(final: Path) -> bool:
    """Whether a file renamed over ``final`` would be the same file to everyone else: the
    folder takes new names, and ``final`` is new or a regular file that is ours (owner and
    group), writable by us and has no other link.  A rename would otherwise give another
    user's file to us, lift its write protection, or cut it off from its hard links."""
    if not os.access(final.parent, os.W_OK | os.X_OK):
        return False
    try:
        info = final.stat()
    except FileNotFoundError:
        return True
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_nlink == 1
        and (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid())
        and os.access(final, os.W_OK)
    )


@contextlib.contextmanager
def _in_place(target: Path) -> Iterator[IO[bytes]]:
    """``target`` truncated and written, as ``> FILE`` does; opening it is what checks that
    we may write it.  Cut short, it holds only part of the message, and is left so (never
    removed: it is not ours to remove), which the error says."""
    with target.open("wb") as out:
        try:
            yield out
        except ApiError as exc:
            raise ApiError(
                exc.status, f"{exc.message}; {target} holds only part of the message"
            ) from None


def _new_file_mode() -> int:
    umask = os.umask(0)  # only readable by setting it: set back at once
    os.umask(umask)
    return 0o666 & ~umask


def _source(api: ApiClient, args: argparse.Namespace) -> Result:
    source = V1 + quoted_path("messages", args.id, "source")
    if args.output is None:
        api.download(source, lambda: contextlib.nullcontext(sys.stdout.buffer))
        sys.stdout.buffer.flush()
        return None, ""
    target = Path(args.output)
    try:
        api.download(source, lambda: _replacing(target))
    except OSError as exc:  # opening or renaming: the operator's path, not the API
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from exc
    return None, ""


def _counted(verb: str) -> Callable[[Any], str]:
    return lambda body: f"{verb} {body['count']} recipient(s)"


def _delete(api: ApiClient, args: argparse.Namespace) -> Result:
    recipient = _filter(args.recipient, "--recipient")
    query = None if recipient is None else [("recipient", recipient)]
    body = api.call("DELETE", V1 + quoted_path("messages", args.id), query=query)
    wire = _on_the_wire(body, "whose attempt may still deliver them (logged if it does)")
    return body, _counted("deleted")(body) + wire


def _purge(api: ApiClient, args: argparse.Namespace) -> Result:
    selection = {
        "zone": _filter(args.zone, "--zone"),
        "state": args.state,
        "sender_domain": _filter(args.sender_domain, "--sender-domain"),
        "recipient_domain": _filter(args.recipient_domain, "--recipient-domain"),
        "older_than": _filter(args.older_than, "--older-than"),
        "all": args.all,
    }
    body = api.call(
        "POST",
        f"{V1}/queue/purge",
        json_body={k: v for k, v in selection.items() if v not in (None, False)},
    )
    return body, _counted("purged")(body)


def _target(args: argparse.Namespace, verb: str) -> str:
    # "is None", not falsiness: an empty id with --zone must not select the zone.
    if (args.id is None) == (_filter(args.zone, "--zone") is None):
        raise UsageError(f"{verb}: give a message id or --zone, one of them")
    return V1 + (
        quoted_path("messages", args.id, verb)
        if args.id is not None
        else quoted_path("zones", args.zone, verb)
    )


def _retry(api: ApiClient, args: argparse.Namespace) -> Result:
    if args.domain is not None and not args.domain.strip().rstrip("."):
        # As the API says it: an empty domain would otherwise widen to the whole zone.
        raise UsageError("domain: must not be empty: leave the field out to match any")
    zone = _filter(args.zone, "--zone")
    if args.domain is not None and args.id is not None:
        # The API retries a whole message (its deferred recipients, every domain): refused
        # rather than silently retrying more than the operator asked for.
        raise UsageError("retry: --domain goes with --zone or alone, not with a message id")
    if args.domain is not None and zone is None and args.id is None:
        body = api.call("POST", V1 + quoted_path("domains", args.domain, "retry"))
    else:
        query = [("domain", args.domain)] if args.domain is not None else None
        body = api.call("POST", _target(args, "retry"), query=query)
    return body, _counted("retrying")(body)


def _on_the_wire(body: dict[str, Any], then: str) -> str:
    """What an answer's ``on_return`` says about recipients on the wire, for people."""
    if not body.get("on_return"):
        return ""
    return f"; {body['on_return']} on the wire, {then}"


def _hold(api: ApiClient, args: argparse.Namespace) -> Result:
    if not args.reason.strip():  # the reason is what browse shows for a held recipient
        raise UsageError("--reason: must not be empty: say why, or leave the option out")
    body = api.call("POST", _target(args, "hold"), json_body={"reason": args.reason})
    wire = _on_the_wire(body, "held when their attempt ends undelivered")
    return body, _counted("held")(body) + wire


def _release(api: ApiClient, args: argparse.Namespace) -> Result:
    body = api.call("POST", _target(args, "release"))
    wire = _on_the_wire(body, "no longer held when their attempt ends")
    return body, _counted("released")(body) + wire


def _move(api: ApiClient, args: argparse.Namespace) -> Result:
    move = {"to": args.to, "state": args.state}
    body = api.call(
        "POST",
        V1 + quoted_path("zones", args.zone, "move"),
        json_body={k: v for k, v in move.items() if v is not None},
    )
    text = f"{body['count']} moved, {body['in_flight']} in flight left"
    return body, text


def _pause(api: ApiClient, args: argparse.Namespace) -> Result:
    body = api.call("POST", V1 + quoted_path("zones", args.zone, "pause"))
    return body, f"zone {args.zone} paused"


def _resume(api: ApiClient, args: argparse.Namespace) -> Result:
    body = api.call("POST", V1 + quoted_path("zones", args.zone, "resume"))
    return body, f"zone {args.zone} resumed"


def _length(data: IO[bytes]) -> int | None:
    """The octets left in ``data`` if it is a regular file, else None: a pipe, a terminal or
    a process substitution has no length until it is read to its end, so it goes chunked."""
    info = os.fstat(data.fileno())
    return info.st_size - data.tell() if stat.S_ISREG(info.st_mode) else None


def _opened(name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
    """The message file to send, open for reading: ``-`` is standard input, as for
    ``zoneq suppression --file -``; a pipe or a device such as /dev/stdin is read too."""
    if name == "-":
        if sys.stdin is None:  # started with descriptor 0 closed (``<&-``)
            raise UsageError("-: standard input is closed")
        return contextlib.nullcontext(sys.stdin.buffer)  # not closed: it is not ours
    path = Path(name)
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise UsageError(f"no such file: {name}") from None
    except IsADirectoryError:
        raise UsageError(f"{name}: is a directory, not a message file") from None
    except OSError as exc:  # a socket (ENXIO), no permission, ...
        what = "not a regular file" if path.exists() and not path.is_file() else "cannot read"
        raise UsageError(f"{name}: {what}: {exc.strerror or exc}") from None


def _send(api: ApiClient, args: argparse.Namespace) -> Result:
    query = [("to", rcpt) for rcpt in args.to]
    if args.sender is not None:
        query.insert(0, ("from", args.sender))
    with _opened(args.file) as data:
        body = api.upload(f"{V1}/messages/raw", data, _length(data), query)
    lines = [f"queued as {body['id']} for {len(body['recipients'])} recipient(s)"]
    # Refused by a plugin (e.g. a suppression list): the rest were queued all the same.
    lines.extend(
        f"refused {printable(r['recipient'])}: {printable(r['reply'])}"
        for r in body.get("refused", [])
    )
    return body, "\n".join(lines)


def run_action(action: Callable[[ApiClient, argparse.Namespace], Result]) -> Callable[..., int]:
    def run(args: argparse.Namespace) -> int:
        try:
            body, text = action(client_from(args), args)
        except (UsageError, InvalidRequest) as exc:
            # The command line is wrong, not the API: like argparse's own usage errors,
            # nothing on stdout.
            print(f"zoneq: {exc}", file=sys.stderr)
            return 2
        except ApiError as exc:
            if args.json:  # a script parses stdout: the API's own error body, not nothing
                print(json.dumps(exc.json(), indent=2))
            print(f"zoneq: {printable(exc.message)} ({exc.status})", file=sys.stderr)
            return 1
        if args.json and body is not None:
            print(json.dumps(body, indent=2))
        elif text:
            print(text)
        return 0

    return run


# --- the parsers -------------------------------------------------------------------------


def connection_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=None, help="a zones.toml file")
    common.add_argument("--api", default=None, help=f"host:port of the API (or {ENV_API})")
    common.add_argument("--token", default=None, help=f"API token (or {ENV_TOKEN})")
    common.add_argument("--json", action="store_true", help="the API's JSON, for scripts")
    return common


def register(sub: Any) -> None:
    """Add ``queue`` and ``send`` to the ``zoneq`` command's subparsers."""
    common = connection_options()
    queue = sub.add_parser("queue", help="look at and manage the queue (through the API)")
    actions = queue.add_subparsers(dest="action", required=True)

    def add(name: str, text: str, action: Callable[[ApiClient, argparse.Namespace], Result]) -> Any:
        parser = actions.add_parser(name, help=text, parents=[common])
        parser.set_defaults(func=run_action(action))
        return parser

    add("counts", "recipients per zone and state", _counts)
    browse = add("browse", "a zone's recipients, oldest first, a page at a time", _browse)
    browse.add_argument("zone")
    browse.add_argument("--state", default="ready", choices=STATES)
    browse.add_argument("--limit", type=int, default=100)
    browse.add_argument("--cursor", default=None, help="from the previous page")
    add("show", "a message and its recipients", _show).add_argument("id")
    source = add("source", "a message's text as stored", _source)
    source.add_argument("id")
    source.add_argument("-o", "--output", default=None, help="write to this file")
    delete = add("delete", "delete a message (or one recipient), no DSN", _delete)
    delete.add_argument("id")
    delete.add_argument("--recipient", default=None)
    purge = add("purge", "delete every recipient matching the filters, no DSN", _purge)
    purge.add_argument("--zone")
    purge.add_argument("--state", choices=("ready", "deferred", "held"))
    purge.add_argument("--sender-domain")
    purge.add_argument("--recipient-domain")
    purge.add_argument("--older-than", help='e.g. "2h", "3d"')
    purge.add_argument("--all", action="store_true", help="required without any filter")
    for name, text, action in (
        ("retry", "deferred recipients are ready now (message, zone or --domain)", _retry),
        ("hold", "hold a message or a zone", _hold),
        ("release", "release a held message or zone", _release),
    ):
        parser = add(name, text, action)
        parser.add_argument("id", nargs="?", default=None, help="a message id")
        parser.add_argument("--zone", default=None)
        if name == "retry":
            parser.add_argument("--domain", default=None, help="a destination domain")
        if name == "hold":
            parser.add_argument("--reason", default="held by administrator")
    move = add("move", "move a zone's recipients to another zone, each in its state", _move)
    move.add_argument("--zone", required=True, help="the zone they are in")
    move.add_argument("--to", required=True, help="a configured zone")
    move.add_argument("--state", choices=("ready", "deferred", "held"))
    add("pause", "stop a zone's deliveries (mail still queues)", _pause).add_argument("zone")
    add("resume", "resume a zone's deliveries", _resume).add_argument("zone")

    send = sub.add_parser("send", help="queue a message file (RFC 5322)", parents=[common])
    send.add_argument("file")
    send.add_argument("--from", dest="sender", default=None, help='envelope sender ("" for <>)')
    send.add_argument(
        "--to", action="append", default=[], help="envelope recipient (repeat); none: headers"
    )
    send.set_defaults(func=run_action(_send))
