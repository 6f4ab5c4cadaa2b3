"""Find the user's App from a ``module:attribute`` reference."""

from __future__ import annotations

import importlib
import sys

from awa_fast.errors import ConfigError


def load_app(ref: str):  # noqa: ANN201 - returns awa_fast.app.App
    """Import ``module.path:attribute`` (the current directory is importable) and return the App."""
    from awa_fast.app import App

    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"app reference {ref!r} must look like 'package.module:app'")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for app {ref!r}: {exc}") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{module_name!r} has no attribute {attr!r}")
    if not isinstance(obj, App):
        raise ConfigError(f"{ref!r} is a {type(obj).__name__}, not an awa_fast.App")
    return obj
