"""Per-attempt hooks that optional features install (tracing, the job context of log lines).

The claimer reads one module attribute per attempt, :data:`around`: None
unless a feature is installed, so an attempt costs one attribute load and
one comparison when nothing is. When set, it is a function of the
:class:`~awa_fast.jobs.Job` returning a context manager that encloses the
handler's call (an exception the handler raises passes through it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

Scope = Callable[[Any], contextlib.AbstractContextManager[None]]

# None: no hook installed (the hot path checks only this).
around: Scope | None = None

_installed: dict[str, Scope] = {}
_lock = threading.Lock()


def install(name: str, scope: Scope) -> None:
    """Install (or replace) the per-attempt scope ``name``; scopes nest in installation order."""
    with _lock:
        _installed[name] = scope
        _rebuild()


def uninstall(name: str) -> None:
    """Remove the per-attempt scope ``name`` (nothing happens if it is not installed)."""
    with _lock:
        _installed.pop(name, None)
        _rebuild()


def installed() -> tuple[str, ...]:
    """Names of the installed per-attempt scopes, outermost first."""
    return tuple(_installed)


def _rebuild() -> None:
    global around
    scopes = tuple(_installed.values())
    if not scopes:
        around = None
    elif len(scopes) == 1:
        around = scopes[0]
    else:
        @contextlib.contextmanager
        def nested(job: Any) -> Iterator[None]:
            with contextlib.ExitStack() as stack:
                for scope in scopes:
                    stack.enter_context(scope(job))
                yield
        around = nested
