"""The ``zoneq`` command line.

Each command imports what it runs when it runs.  The supervisor starts every zone worker
and receiver process through this module, and importing all of zoneq for each (the HTTP
API, aiohttp, the exporters) cost a worker 1.2 s of CPU and 74 MB at its peak, against
0.5 s and 43 MB for what it uses; so those two internal commands build only their own
parsers (``_INTERNAL``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from zoneq import __version__, logs
from zoneq.config import Config, load_config, loads_config
from zoneq.config.loader import config_source, read_config_text
from zoneq.errors import ConfigError, DataDirError, ListenError, StoreLocked

# Started by ``zoneq serve``, never by hand: their parsers are all these processes need.
_INTERNAL = frozenset({"worker", "receiver"})

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        # Read once: this text, not the file as it may be edited later, is what every
        # worker runs (the supervisor hands it to them; there is no reload).
        text = read_config_text(args.config)
        # serving: serve binds the listen addresses and its workers the pools' source
        # addresses, so they must be this host's (found here, before the queue opens).
        config = loads_config(text, source=config_source(args.config), serving=True)
    except ConfigError as exc:
        print(f"zoneq: configuration error:\n{exc}", file=sys.stderr)
        return 2
    from zoneq import runtime

    try:
        runtime.run(config, args.config, text)
    except ConfigError as exc:  # found at start-up: a plugin's init refused (issue 5)
        print(f"zoneq: configuration error:\n{exc}", file=sys.stderr)
        return 2
    except (StoreLocked, ListenError, DataDirError) as exc:
        print(f"zoneq: {exc}", file=sys.stderr)
        return 1
    return 0


def _child_config(args: argparse.Namespace) -> Config:
    """A worker's or receiver's config: with ``--config-on-stdin`` the text serve loaded at
    its start (``--config`` only names it), so an edit of the file since then reaches no
    restarted child (there is no reload); else the file, for a child started by hand.

    A worker binds its zone's source addresses, so it checks the pools are this host's
    (a receiver binds none: it is handed serve's sockets)."""
    pools = args.command == "worker"
    if not args.config_on_stdin:
        return load_config(args.config, pools=pools)
    text = sys.stdin.buffer.read().decode("utf-8")  # serve read it as UTF-8
    return loads_config(text, source=config_source(args.config), pools=pools)


def _cmd_worker(args: argparse.Namespace) -> int:
    try:
        config = _child_config(args)
    except ConfigError as exc:
        print(f"zoneq worker: configuration error:\n{exc}", file=sys.stderr)
        return 2
    if args.zone not in config.zones:
        print(f"zoneq worker: no zone {args.zone!r} in the configuration", file=sys.stderr)
        return 2
    from zoneq.delivery import worker

    return worker.main(config, args.zone, args.name)


def _cmd_receiver(args: argparse.Namespace) -> int:
    try:
        config = _child_config(args)
    except ConfigError as exc:
        print(f"zoneq receiver: configuration error:\n{exc}", file=sys.stderr)
        return 2
    from zoneq.receiver import process

    return process.main(config, args.name, args.listen_fd, args.intake_fd, args.tls_listen_fd)


def _cmd_check_config(args: argparse.Namespace) -> int:
    from zoneq.plugin.check import config_problems

    path: Path | None = args.config or args.config_option
    # The loader's faults and what start-up would find next: each plugin's own init (key
    # files, zones, events), run for every plugin that loads even when another did not.
    problems, config = config_problems(path)
    warnings: list[str] = []
    if config is not None:  # and the API token, read as serve reads it
        problems += _token_problems(config, warnings)
        if (warning := config.server.hostname_warning()) is not None:  # serve logs it too
            warnings.append(warning)
    where = path if path is not None else "the built-in configuration"
    for line in warnings:
        print(f"{where}: warning: {line}", file=sys.stderr)
    if problems:
        print(f"{where}: {len(problems)} problem(s)", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"{where}: ok")
    return 0


def _token_problems(config: Config, warnings: list[str]) -> list[str]:
    """The API token's problems as serve would meet them (``find_token``, the same read);
    a token file others can read is appended to ``warnings``."""
    from zoneq.api.token import find_token, token_warning

    try:
        find_token(config)
    except ConfigError as exc:
        return [str(exc)]
    if (warning := token_warning(config)) is not None:
        warnings.append(warning)
    return []


def build_parser(*, internal_only: bool = False) -> argparse.ArgumentParser:
    """The whole command line; ``internal_only``: without the commands people use, whose
    modules are the heavy ones."""
    parser = argparse.ArgumentParser(prog="zoneq", description="zone-routing mail delivery engine")
    parser.add_argument("--version", action="version", version=f"zoneq {__version__}")
    # Checked by argparse, so that an unknown level is a usage error (exit 2) and not a
    # traceback from logging.basicConfig.
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=_LOG_LEVELS,
        help="DEBUG, INFO, WARNING or ERROR (any case)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run zoneq (the built-in config unless --config)")
    serve.add_argument("--config", type=Path, default=None, help="a zones.toml file")
    serve.set_defaults(func=_cmd_serve)

    work = sub.add_parser("worker", help="a zone worker (started by serve, not by hand)")
    work.add_argument("--zone", required=True)
    work.add_argument("--name", required=True)
    _add_config_options(work)
    work.set_defaults(func=_cmd_worker)

    rx = sub.add_parser("receiver", help="an SMTP receiver (started by serve, not by hand)")
    rx.add_argument("--name", required=True)
    rx.add_argument("--listen-fd", type=int, required=True, help="the core's listening socket")
    rx.add_argument("--intake-fd", type=int, required=True, help="the socket to the core")
    rx.add_argument(
        "--tls-listen-fd", type=int, default=None, help="the core's implicit-TLS listening socket"
    )
    _add_config_options(rx)
    rx.set_defaults(func=_cmd_receiver)

    check = sub.add_parser("check-config", help="validate a config file and name each problem")
    # Also as --config, the way serve takes it: the same file, so the same spelling works.
    where = check.add_mutually_exclusive_group()
    where.add_argument(
        "config", type=Path, nargs="?", default=None, metavar="FILE", help="a zones.toml file"
    )
    where.add_argument(
        "--config", dest="config_option", type=Path, default=None, metavar="FILE", help="the same"
    )
    check.set_defaults(func=_cmd_check_config)

    if internal_only:
        return parser
    from zoneq.analytics import command as analytics_command
    from zoneq.api import command as api_command
    from zoneq.api import suppression_command
    from zoneq.export import command as export_command
    from zoneq.receiver import hash_password

    api_command.register(sub)  # zoneq queue ..., zoneq send
    suppression_command.register(sub)  # zoneq suppression list|add|remove|check
    export_command.register(sub)
    analytics_command.register(sub)
    hash_password.register(sub)  # for receiver.auth_users
    return parser


def _add_config_options(child: argparse.ArgumentParser) -> None:
    """A child's config options, read by ``_child_config``."""
    child.add_argument("--config", type=Path, default=None)
    child.add_argument(
        "--config-on-stdin",
        action="store_true",
        help="read the config's text from stdin (serve's), --config only naming it",
    )


def _command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (the first word that is not an option or the value
    of ``--log-level``), if any."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(internal_only=_command_of(words) in _INTERNAL)
        args = parser.parse_args(words)
        logs.configure(args.log_level)
        code: int = args.func(args)
    except BrokenPipeError:
        # The reader went away (``zoneq queue show ID | head``): stop quietly, as a shell
        # tool does.  stdout goes to /dev/null so that the flush at exit does not raise
        # again (the Python documentation's advice for SIGPIPE).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
