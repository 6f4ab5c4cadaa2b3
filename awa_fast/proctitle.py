"""Readable process titles for ``supervise`` and its children (extra ``awa-fast[proctitle]``).

With ``setproctitle`` installed, ``ps`` and ``/proc/PID/cmdline`` show
``awa-fast: supervisor app.jobs:app``, ``awa-fast: claimer queue=email
stripe=1``, ``awa-fast: maintenance`` (``maintenance (leader)`` while it leads) and ``awa-fast: metrics``. Without
it nothing changes. A title is built from the role and queue names only,
never from the command line, so it cannot carry a DSN or its password;
setting one also replaces the arguments ``ps`` showed (a ``--dsn`` among
them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

PREFIX = "awa-fast: "

# The title this module set in this process (None: never set, e.g. an in-process worker's thread).
_current: str | None = None


def available() -> bool:
    """True when ``setproctitle`` can be imported."""
    try:
        import setproctitle  # noqa: F401
    except ImportError:
        return False
    return True


def set_title(title: str) -> bool:
    """Set this process's title to ``awa-fast: <title>``; False when ``setproctitle`` is missing."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return False
    global _current
    setproctitle(PREFIX + title)
    _current = title
    return True


def mark_leader(leading: bool) -> None:
    """Show ``maintenance (leader)`` while this maintenance process leads; nothing in a process whose
    title this module did not set to the maintenance one (an in-process worker keeps its own)."""
    if _current in ("maintenance", "maintenance (leader)"):
        set_title("maintenance (leader)" if leading else "maintenance")


def child_title(name: str) -> str:
    """The title of a supervisor child from its name: ``claimer email#1`` -> ``claimer queue=email stripe=1``."""
    role, _, rest = name.partition(" ")
    if role == "claimer" and "#" in rest:
        queue, _, stripe = rest.rpartition("#")
        return f"claimer queue={queue} stripe={stripe}"
    return name


def titled(target: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``target`` that first sets the title of the (forked) child it runs in."""
    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> Any:
        set_title(child_title(name))
        return target(*args, **kwargs)
    return run
