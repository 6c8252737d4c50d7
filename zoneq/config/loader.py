"""Reading a configuration file and turning every fault into a ``ConfigError`` that names its key.

pydantic reports a fault as a location tuple and a message written for Python programmers
("Input should be a valid integer").  An operator edits TOML, so each fault is restated as
the dotted key they would look for (``zones.bulk.connections``, with TOML quoting for zone
names that contain dots) and a sentence about TOML values.  All faults are reported at once:
fixing a config one start-up attempt at a time is slow.
"""

from __future__ import annotations

import difflib
import re
import socket
import tomllib
import types
from collections.abc import Callable, Iterator, Mapping
from datetime import date, datetime, time
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Final, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from zoneq.config.listen import is_host_name
from zoneq.config.model import CROSS_CHECKED, PROBLEMS_ERROR_TYPE, Config
from zoneq.config.plugins import (
    PluginConfig,
    PluginImportError,
    import_plugin,
    options_model,
    plugin_options,
)
from zoneq.config.types import SIZE_EXPECTED
from zoneq.errors import ConfigError

__all__ = [
    "DEFAULT_CONFIG_NAME",
    "InvalidConfig",
    "Problem",
    "check_config",
    "config_source",
    "default_config_text",
    "dotted_key",
    "load_config",
    "load_plugin",
    "loads_config",
    "problems_from",
    "read_config_text",
    "toml_string",
    "validate_config",
]

DEFAULT_CONFIG_NAME: Final = "default.toml"
"""The embedded default configuration, a resource of this package."""

_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")
_SUGGESTION_CUTOFF: Final = 0.6


class Problem(NamedTuple):
    """One fault: the dotted key (empty for faults of the whole file) and what is wrong."""

    key: str
    text: str

    def __str__(self) -> str:
        return f"{self.key}: {self.text}" if self.key else self.text


class InvalidConfig(ConfigError):
    """A configuration with one or more faults.

    ``key`` and ``problem`` describe the first fault, as for any ``ConfigError``;
    ``problems`` holds all of them and the message lists them one per line.
    """

    def __init__(self, problems: list[Problem], source: str) -> None:
        first = problems[0]
        super().__init__(first.key, first.text)
        self.args = ("\n".join(str(p) for p in problems),)
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.source = source
        self.model: Config | None = None  # the model, when only later checks failed

    # Exceptions are rebuilt from ``args`` when unpickled (as when a worker process reports
    # one to its parent), and ``args`` here is the joined message, not our parameters.
    def __reduce__(self) -> tuple[type[InvalidConfig], tuple[list[Problem], str]]:
        return (type(self), (list(self.problems), self.source))


def default_config_text() -> str:
    """The text of the embedded default configuration."""
    return resources.files("zoneq.config").joinpath(DEFAULT_CONFIG_NAME).read_text(encoding="utf-8")


def load_config(path: Path | None = None, *, serving: bool = False, pools: bool = False) -> Config:
    """Read, parse and validate the configuration at ``path`` (the embedded default if None).

    Raises ``ConfigError`` if the file cannot be read, and ``InvalidConfig`` (a
    ``ConfigError``) listing every fault if it is not valid TOML or not a valid config.
    ``serving``, ``pools``: as ``validate_config``.
    """
    source = config_source(path)
    return loads_config(read_config_text(path), source=source, serving=serving, pools=pools)


def config_source(path: Path | None) -> str:
    """How messages name the configuration at ``path`` (the embedded default if None)."""
    return f"<embedded {DEFAULT_CONFIG_NAME}>" if path is None else str(path)


def read_config_text(path: Path | None) -> str:
    """The text of the configuration at ``path`` (the embedded default if None), unparsed:
    serve hands the very text it loaded to its workers.  Raises ``ConfigError`` if the file
    cannot be read or is not UTF-8."""
    if path is None:
        return default_config_text()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("", f"config file {str(path)!r} does not exist") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        # TOML files are UTF-8 by definition; give the offset so the byte can be found.
        raise ConfigError(
            "", f"config file {str(path)!r} is not UTF-8 (bad byte at offset {exc.start})"
        ) from None


def loads_config(
    text: str, source: str = "<string>", *, serving: bool = False, pools: bool = False
) -> Config:
    """Parse and validate configuration text; ``source`` names it in messages.
    ``serving``, ``pools``: as ``validate_config``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # The message already ends "(at line L, column C)".
        raise InvalidConfig([Problem("", f"{source}: invalid TOML: {exc}")], source) from None
    return validate_config(data, source, serving=serving, pools=pools)


def validate_config(
    data: Mapping[str, Any],
    source: str = "<data>",
    *,
    serving: bool = False,
    pools: bool = False,
) -> Config:
    """Validate already-parsed configuration data (as ``tomllib`` returns it).

    After the model, enabled plugins must import with valid options, and the checks that
    ask this machine run for the processes that bind those addresses.  Nothing starts
    half-configured.

    ``serving``: require the listen addresses and the pools' source addresses to be this
    host's, for serve's own start-up and check-config.  ``pools``: the pools' only, for a
    zone worker, which binds them.  No other process binds either: the receiver children
    get serve's sockets, the admin CLI and export none.  A worker restarted after a
    failover moved the receiver's address to another host must still start, and the CLI
    must run on any host that shares the config.
    """
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        faulty = {error["loc"][0] for error in exc.errors() if error["loc"]}
        problems = [*problems_from(exc), *_cross_problems(data, faulty)]
        raise InvalidConfig(problems, source) from None
    pool = list(_pool_problems(config)) if serving or pools else []
    listen = list(_listen_problems(config)) if serving else []
    problems = [*pool, *listen, *_plugin_problems(config)]
    if problems:
        refused = InvalidConfig(problems, source)
        refused.model = config  # check-config runs the plugins' init on it
        raise refused
    return config


def _cross_problems(data: Mapping[str, Any], faulty: set[int | str]) -> list[Problem]:
    """The faults of ``Config``'s own checks (zone references, the API's address) when
    pydantic skipped them for faults in the ``faulty`` sections, so that one run lists a
    bad ``storage`` value and an undefined ``routing.default_zone`` together.

    Exact, never a guess: it runs only when those checks read no faulty section, and then
    validates the file without the faulty sections, which the checks do not read.
    """
    if not faulty or faulty & CROSS_CHECKED:  # none: the checks ran and are reported
        return []
    try:
        Config.model_validate({key: value for key, value in data.items() if key not in faulty})
    except ValidationError as exc:
        return problems_from(exc)
    return []


def check_config(path: Path | None = None) -> list[str]:
    """Every fault of the configuration at ``path`` as one line each; empty when it is valid."""
    try:
        load_config(path, serving=True)  # the verdict serve would give
    except InvalidConfig as exc:
        return [str(p) for p in exc.problems]
    except ConfigError as exc:
        return [str(exc)]
    return []


def problems_from(exc: ValidationError, root: type[BaseModel] = Config) -> list[Problem]:
    """Restate pydantic's errors as dotted keys and operator-facing sentences.

    ``root`` is the model that was validated (a plugin's ``Options`` for its options
    table): an unknown key is answered with the keys of the table it is in, found by
    walking ``root``'s fields along the key.
    """
    problems: list[Problem] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        ctx = error.get("ctx") or {}
        if error["type"] == PROBLEMS_ERROR_TYPE:
            # A model-level check that named the keys at fault itself.
            problems.extend(Problem(dotted_key(loc + tuple(k)), t) for k, t in ctx["problems"])
        else:
            problems.append(Problem(dotted_key(loc), _describe(error, root)))
    return problems


def dotted_key(loc: tuple[int | str, ...]) -> str:
    """``("zones", "mx.example", "retry")`` -> ``zones."mx.example".retry`` (TOML key syntax).

    pydantic adds ``[key]`` to the location of a fault in a dict key; the key itself is
    the part before it, so the marker is dropped.
    """
    out = ""
    for part in loc:
        if part == "[key]":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        name = part if _BARE_KEY.fullmatch(part) else toml_string(part)
        out = f"{out}.{name}" if out else name
    return out


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string, as it could be pasted back into the file.

    Not ``json.dumps``: it writes characters beyond U+FFFF as surrogate-pair escapes,
    which TOML refuses, and leaves DEL unescaped, which TOML also refuses.
    """
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif char < " " or char == "\x7f":
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


_ESCAPES: Final[dict[str, str]] = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _describe(error: ErrorDetails, root: type[BaseModel]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    got = _toml_value(error["input"])
    if kind == "extra_forbidden":
        return _unknown_key(tuple(error["loc"]), root)
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {got}"
    if kind in _LIMITS:
        return _LIMITS[kind].format(**ctx, got=got)
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    # "missing" and our own PydanticCustomErrors (durations, zone names, retry schedules)
    # already read well; anything else is rare enough that pydantic's wording will do.
    return _PLAIN.get(kind, error["msg"])


_EXPECTED: Final[dict[str, str]] = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "path_type": "a path string",
    "model_type": "a table",
    "model_attributes_type": "a table",
    "dict_type": "a table",
    "list_type": "an array",
    # ByteSize's own "could not parse value and unit from byte string" says what is wrong,
    # not what would be right.
    "byte_size": SIZE_EXPECTED,
    "byte_size_unit": SIZE_EXPECTED,
    "size": SIZE_EXPECTED,
}

# Formatted with the error's context and ``got``, the value as written.
_LIMITS: Final[dict[str, str]] = {
    "greater_than_equal": "must be {ge} or more, got {got}",
    "greater_than": "must be more than {gt}, got {got}",
    "less_than_equal": "must be {le} or less, got {got}",
    "less_than": "must be less than {lt}, got {got}",
    "literal_error": "must be one of {expected}, got {got}",
    # Not the value: this is how short tokens and secrets are (api.token, a plugin's).
    "string_too_short": "must be at least {min_length} characters long",
}

_PLAIN: Final[dict[str, str]] = {
    "missing": "required key is missing",
}

# Checked in order: bool before int, since a Python bool is also an int.
_TOML_TYPES: Final[tuple[tuple[type, Callable[[Any], str]], ...]] = (
    (bool, lambda v: f"boolean {str(v).lower()}"),
    (int, lambda v: f"integer {v}"),
    (float, lambda v: f"float {v}"),
    (str, lambda v: f"string {toml_string(v)}"),
    (dict, lambda _: "a table"),
    (list, lambda _: "an array"),
    # datetime before date: a datetime is also a date.
    (datetime, lambda v: f"date-time {v.isoformat()}"),
    (date, lambda v: f"date {v.isoformat()}"),
    (time, lambda v: f"time {v.isoformat()}"),
)


def _toml_value(value: object) -> str:
    """Name a parsed TOML value the way the operator wrote it."""
    for kind, render in _TOML_TYPES:
        if isinstance(value, kind):
            return render(value)
    return repr(value)


def _unknown_key(loc: tuple[int | str, ...], root: type[BaseModel]) -> str:
    known = _known_keys(loc[:-1], root)
    if not known:
        return "unknown key"
    wrong = str(loc[-1])
    close = difflib.get_close_matches(wrong, known, n=1, cutoff=_SUGGESTION_CUTOFF)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key; known keys here: {', '.join(known)}"


def _known_keys(loc: tuple[int | str, ...], root: type[BaseModel]) -> list[str]:
    """The keys the model at ``loc`` accepts, found by walking ``root``'s schema along ``loc``."""
    node: Any = root
    for part in loc:
        model = _model_in(node)
        if model is None:
            # A dict (zones) or an array (routing.rules): the part is a name chosen by the
            # operator or an index; step to the values.
            node = _item_type(node)
            if node is None:
                return []
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        node = field.annotation
    model = _model_in(node)
    return list(model.model_fields) if model is not None else []


def _model_in(node: Any) -> type[BaseModel] | None:
    for candidate in _flatten(node):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _item_type(node: Any) -> Any:
    """The type of a dict's values or of an array's items."""
    for candidate in _flatten(node):
        if get_origin(candidate) in (dict, list):
            return get_args(candidate)[-1]
    return None


def _flatten(node: Any) -> Iterator[Any]:
    """The alternatives of a union (``X | None``), or the node itself; ``Annotated``
    metadata (validators of a plugin's own types) set aside."""
    if get_origin(node) in (Union, types.UnionType):
        for arg in get_args(node):
            yield from _flatten(arg)
    elif get_origin(node) is Annotated:
        yield from _flatten(get_args(node)[0])
    else:
        yield node


# --- checks that ask this machine ---------------------------------------------------------------


def _pool_problems(config: Config) -> Iterator[Problem]:
    """A pool address that is not one of this host's would fail every connection from it.
    Only when ``serving`` or ``pools`` (``validate_config``): only a worker binds these."""
    for zone_name, zone in config.zones.items():
        for index, entry in enumerate(zone.pool):
            reason = _bind_failure(entry.address)
            if reason is not None:
                key = dotted_key(("zones", zone_name, "pool", index, "address"))
                text = f"{entry.address} is not an address of this host ({reason})"
                yield Problem(key, text)


def _listen_problems(config: Config) -> Iterator[Problem]:
    """A listen address that is not one of this host's would stop serve at start-up, after
    the queue is opened; said here, with its key, check-config finds it too.  Only when
    ``serving`` (``validate_config``): no other process binds these addresses."""
    listeners = [
        ("receiver", "listen", config.receiver.listen_address),
        ("receiver", "tls_listen", config.receiver.tls_listen_address),
        ("api", "listen", config.api.listen_address if config.api.enabled else None),
    ]
    for section, key, address in listeners:
        if address is None or is_host_name(address[0]):
            continue
        reason = _bind_failure(address[0])
        if reason is not None:
            text = f"{address[0]} is not an address of this host ({reason})"
            yield Problem(dotted_key((section, key)), text)


def _bind_failure(address: str) -> str | None:
    # Port 0 binds no port anyone could notice; the kernel refuses an address that is not
    # configured on an interface (EADDRNOTAVAIL), which is exactly the question.
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        return f"bind failed: {exc.strerror or exc}"
    return None


def load_plugin(
    name: str, plugin: PluginConfig
) -> tuple[types.ModuleType, BaseModel | dict[str, Any]]:
    """Plugin ``name``'s module and validated options (what the plugin host initialises).

    Raises ``InvalidConfig`` naming each fault's key: ``plugins.<name>.module`` (or the
    plugin's table) when it cannot be imported, ``plugins.<name>.options.<key>`` per option.
    """
    try:
        module = import_plugin(name, plugin)
    except PluginImportError as exc:
        # Blame the module key when the operator wrote one, else the plugin's table.
        loc = ("plugins", name, "module") if plugin.module is not None else ("plugins", name)
        raise InvalidConfig([Problem(dotted_key(loc), str(exc))], f"plugins.{name}") from None
    try:
        options = plugin_options(module, plugin)
    except ValidationError as exc:
        prefix = dotted_key(("plugins", name, "options"))
        # Only a plugin with an Options model raises this; its fields are the known keys.
        root = options_model(module) or BaseModel
        problems = [
            Problem(f"{prefix}.{problem.key}" if problem.key else prefix, problem.text)
            for problem in problems_from(exc, root)
        ]
        raise InvalidConfig(problems, f"plugins.{name}") from None
    return module, options


def _plugin_problems(config: Config) -> Iterator[Problem]:
    for name, plugin in config.plugins.items():
        if not plugin.enabled:
            continue
        try:
            load_plugin(name, plugin)
        except InvalidConfig as exc:
            yield from exc.problems
