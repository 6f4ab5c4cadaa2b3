"""Find the user's App from a ``module:attribute`` reference."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING

from awa_fast.errors import ConfigError

if TYPE_CHECKING:
    from awa_fast.app import App

log = logging.getLogger("awa_fast.loader")


def _cwd_on_path() -> bool:
    cwd = os.getcwd()
    return any(entry in ("", ".") or (entry and os.path.abspath(entry) == cwd) for entry in sys.path)


def _make_importable(module_name: str) -> None:
    """Put the working directory at the *end* of ``sys.path``, and only when the app needs it.

    An app module installed in the environment is imported from there: the
    directory ``awa-fast`` runs in (a source checkout, say) never shadows an
    installed module. Only a top-level package found nowhere else makes the
    working directory importable, after everything installed.
    """
    if _cwd_on_path():
        return  # the interpreter put it there (python -m, python -c): its rules, not ours
    top = module_name.split(".", 1)[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        sys.path.append(os.getcwd())


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" ({last.filename}:{last.lineno})"


def load_app(ref: str) -> App:
    """Import ``module.path:attribute`` and return the App.

    The module is imported from the environment; the working directory is
    searched only for a package not installed (see :func:`_make_importable`).
    Any failure while importing it, an exception or ``sys.exit()``, is a
    :class:`ConfigError` naming it in one line (the CLI exits 2).
    """
    from awa_fast.app import App

    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"app reference {ref!r} must look like 'package.module:app'")
    _make_importable(module_name)
    from awa_fast.logs import user_config_window

    try:
        with user_config_window():  # a logging configuration in the app module wins over the CLI's
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for app {ref!r}: {exc}") from None
    except SystemExit as exc:
        raise ConfigError(f"importing {module_name!r} for app {ref!r} called sys.exit({exc.code!r}); "
                          "an app module must not exit when imported") from None
    except Exception as exc:  # noqa: BLE001 - the user's module: any failure is a configuration error
        log.debug("importing %s failed", module_name, exc_info=True, extra={"action": "app_import_failed"})
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"importing {module_name!r} for app {ref!r} raised {type(exc).__name__}"
                          f"{': ' + first if first else ''}{_where(exc)}") from None
    obj: object = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{module_name!r} has no attribute {attr!r}")
    if not isinstance(obj, App):
        raise ConfigError(f"{ref!r} is a {type(obj).__name__}, not an awa_fast.App")
    return obj
