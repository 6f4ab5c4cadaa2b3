"""The watchdog of one claimer: hung I/O and handler timeouts, on its own thread.

Each role that blocks on a database connection of its own (the claim loop's
claims, the completion batcher's flushes, the listener's ``LISTEN``) owns an
:class:`IoGuard` and reports the operation in flight on it: ``begin(conn)`` before, ``end()`` after. Every
tick the watchdog looks at each guard; an operation without an answer for
``io_timeout`` seconds is taken as a half-open connection and its socket is
shut down, which turns the hang into an error its owner's loop already
recovers from. The watchdog never reads another role's attributes and never
runs a query.

The same tick calls the ``on_tick`` hooks (the executor's handler-timeout
check), each guarded apart: one failing hook stops neither the other nor
the thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psycopg

log = logging.getLogger("awa_fast.claimer")


class IoGuard:
    """The operation in flight on one connection, as its owner reports it to the watchdog.

    Only the owner calls :meth:`begin`/:meth:`end`; the watchdog only reads.
    Both live in one attribute, so a read never sees a new start paired with
    an old connection.
    """

    __slots__ = ("what", "_op")

    def __init__(self, what: str) -> None:
        self.what = what
        self._op: tuple[psycopg.Connection, float] | None = None

    def begin(self, conn: psycopg.Connection) -> None:
        self._op = (conn, time.monotonic())

    def end(self) -> None:
        self._op = None

    def overdue(self, now: float, limit: float) -> tuple[psycopg.Connection, float] | None:
        """The connection and age of an operation older than ``limit`` seconds, else None."""
        op = self._op
        if op is not None and now - op[1] > limit:
            return op[0], now - op[1]
        return None


@dataclass(frozen=True, slots=True)
class WatchdogConfig:
    """Watchdog settings."""

    tick: float  # seconds between looks
    io_timeout: float  # an operation unanswered this long is a half-open connection


class Watchdog:
    """The thread that checks a claimer's I/O guards and runs its tick hooks."""

    def __init__(self, config: WatchdogConfig, guards: Sequence[IoGuard],
                 on_tick: Sequence[Callable[[], None]] = (),
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        self.config = config
        self._guards = tuple(guards)
        self._on_tick = tuple(on_tick)
        self._on_death = on_death
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="awa-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def run_once(self) -> int:
        """One look: run the tick hooks, shut down hung connections; returns how many were shut down."""
        for hook in self._on_tick:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook never stops the watchdog
                log.exception("watchdog hook %r failed", hook, extra={"action": "watchdog_error"})
        now = time.monotonic()
        shut = 0
        for guard in self._guards:
            hung = guard.overdue(now, self.config.io_timeout)
            if hung is not None:
                conn, age = hung
                log.error("%s has had no answer for %.0fs: closing its connection", guard.what, age,
                          extra={"action": "io_timeout"})
                shutdown_socket(conn)
                shut += 1
        return shut

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.config.tick):
                self.run_once()
        except BaseException as exc:  # noqa: BLE001 - a bug: the claimer must not run on unwatched
            log.critical("watchdog thread died", exc_info=exc, extra={"action": "watchdog_died"})
            if self._on_death is not None:
                self._on_death(exc)


def shutdown_socket(conn: psycopg.Connection) -> None:
    """Shut down ``conn``'s socket (both ways) so a blocked read on it fails at once."""
    try:
        family = socket.AF_UNIX if conn.info.host.startswith("/") else socket.AF_INET
        dup = socket.fromfd(conn.fileno(), family, socket.SOCK_STREAM)
    except (OSError, psycopg.Error):
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()
