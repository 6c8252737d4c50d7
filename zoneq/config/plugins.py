"""``[plugins.<name>]``: which plugins are enabled, where their code is, and their options.

Finding and importing a plugin's module lives here, below the plugin host, because the
loader must be able to say "this plugin cannot be imported" for ``zoneq check-config``
without starting anything.  Calling hooks is ``zoneq.plugin``'s business.

A plugin module may define ``Options``, a pydantic model; its ``options`` table is
validated against it, so a plugin's misspelt option is reported like any other key.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Final

from pydantic import AfterValidator, BaseModel, Field
from pydantic_core import PydanticCustomError

from zoneq.config.types import Section, TimeLimit, time_limit_s

__all__ = [
    "PLUGIN_DIR",
    "PluginConfig",
    "PluginImportError",
    "PluginName",
    "import_plugin",
    "options_model",
    "plugin_options",
]

PLUGIN_DIR: Final = Path("plugins")
"""Where a plugin without a ``module`` key is looked for: ``plugins/<name>.py``, relative
to the working directory, like ``server.data_dir``."""

# Imported files are registered under this package-like prefix, so they never shadow (or
# are shadowed by) an installed module of the same name.
_FILE_MODULE_PREFIX: Final = "zoneq_plugin_files"


_PLUGIN_NAME: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def _check_plugin_name(value: str) -> str:
    # The name doubles as a file name (plugins/<name>.py) and a logger name.
    if not _PLUGIN_NAME.fullmatch(value):
        reason = (
            f"invalid plugin name {value!r}: use a letter, then up to 63 letters, digits, "
            "'-' or '_'"
        )
        raise PydanticCustomError("plugin_name", "{reason}", {"reason": reason})
    return value


PluginName = Annotated[str, AfterValidator(_check_plugin_name)]


class PluginImportError(ValueError):
    """A plugin's module could not be found, imported, or lacks ``init``."""


class PluginConfig(Section):
    """One ``[plugins.<name>]`` table; plugins are called in the order of the file."""

    enabled: bool = True
    """A disabled plugin is neither imported nor called (kept in the file for later)."""

    module: Annotated[str | None, Field(min_length=1)] = None
    """A Python file (``"plugins/dkim.py"``, a path with a ``/`` or ending in ``.py``) or an
    importable module (``"mycompany.zoneq_plugins.webhook"``).  None: ``plugins/<name>.py``."""

    timeout: TimeLimit = "5s"
    """Time limit of one hook call; past it the call counts as failed (451 at receive time).
    May be under a second ("500ms", "0.5s"): a check on every RCPT wants a short one."""

    # Not strict, and any TOML value: the plugin's own ``Options`` model says what is valid.
    options: Annotated[dict[str, Any], Field(strict=False)] = Field(default_factory=dict)

    @property
    def timeout_s(self) -> float:
        return time_limit_s(self.timeout)


def _is_file_spec(spec: str) -> bool:
    return "/" in spec or spec.endswith(".py")


def import_plugin(name: str, config: PluginConfig) -> ModuleType:
    """The module of plugin ``name``, imported (once per file or module name).

    Raises ``PluginImportError`` naming what was looked for and why it failed; an exception
    raised by the module's own top-level code is reported with its type and message.
    """
    spec = config.module or str(PLUGIN_DIR / f"{name}.py")
    try:
        module = _import_file(Path(spec)) if _is_file_spec(spec) else importlib.import_module(spec)
    except PluginImportError:
        raise
    except ImportError as exc:
        raise PluginImportError(f"cannot import {spec!r}: {exc}") from None
    except (Exception, SystemExit) as exc:  # the plugin's own top-level code failed
        raise PluginImportError(f"importing {spec!r} failed: {type(exc).__name__}: {exc}") from None
    if not callable(getattr(module, "init", None)):
        raise PluginImportError(f"{spec!r} defines no init(app) function")
    return module


def _import_file(path: Path) -> ModuleType:
    resolved = path.resolve()
    if not resolved.is_file():
        raise PluginImportError(f"plugin file {str(path)!r} does not exist")
    # One module per file: importing twice (check at load, host at start) must not run
    # the plugin's top-level code twice, nor confuse two files of the same name.
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    module_name = f"{_FILE_MODULE_PREFIX}_{resolved.stem}_{digest}"
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise PluginImportError(f"{str(path)!r} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before running, as the import system does, so that dataclasses and pydantic
    # models defined in the plugin can find their module by name.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def plugin_options(module: ModuleType, config: PluginConfig) -> BaseModel | dict[str, Any]:
    """The plugin's options, validated by its ``Options`` model when it defines one.

    Raises pydantic's ``ValidationError``; the loader names each fault's key under
    ``plugins.<name>.options``.
    """
    model = options_model(module)
    if model is not None:
        return model.model_validate(config.options)
    return dict(config.options)


def options_model(module: ModuleType) -> type[BaseModel] | None:
    """The plugin's ``Options`` model, or None when it takes any options as a dict."""
    model = getattr(module, "Options", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model
    return None
