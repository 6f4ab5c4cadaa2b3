"""The listener of one claimer: LISTEN/NOTIFY wake-ups on its own thread and connection.

Producers notify the schema's channel with the queue name when a lane's
backlog is short (see ``job_enqueue`` in the migrations); a notification
for this claimer's queue wakes its claim loop. After every (re)LISTEN the
claim loop is woken once, since notifications may have been missed while
the connection was down. An idle LISTEN connection is pinged every
``io_timeout / 2``: a half-open socket delivers neither a notification nor
an error, and only an answer proves it alive; a ping that hangs is cut by
the watchdog through this listener's :class:`~awa_fast.runtime.watchdog.IoGuard`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from awa_fast.errors import DatabaseUnavailable
from awa_fast.runtime.watchdog import IoGuard
from awa_fast.storage import Storage, close_quietly, connect

log = logging.getLogger("awa_fast.claimer")


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """Listener settings."""

    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    queue: str
    io_timeout: float = 10.0


class Listener:
    """Wakes a claim loop when its queue is notified (one thread, one connection, both its own)."""

    def __init__(self, config: ListenerConfig, stopping: threading.Event, on_notify: Callable[[], None]) -> None:
        self.config = config
        self.storage = Storage(config.schema)
        self.guard = IoGuard("LISTEN ping")
        self._stopping = stopping
        self._on_notify = on_notify  # called on this thread: must be quick and never raise
        self._thread = threading.Thread(target=self._run, name="awa-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        cfg = self.config
        backoff = 0.1
        while not self._stopping.is_set():
            conn: psycopg.Connection | None = None
            try:
                conn = connect(cfg.dsn, application_name=f"awa_fast:listen:{cfg.queue}",
                               connect_timeout=int(cfg.io_timeout + 0.999))
                self.storage.channel_listen(conn)
                backoff = 0.1
                self._on_notify()  # poll once after every (re)LISTEN: wakeups may have been missed
                last_ping = time.monotonic()
                while not self._stopping.is_set():
                    for note in conn.notifies(timeout=1.0):
                        if note.payload == cfg.queue:
                            self._on_notify()
                    if time.monotonic() - last_ping >= max(0.5, cfg.io_timeout / 2):
                        self.guard.begin(conn)
                        try:
                            self.storage.session_ping(conn)
                        finally:
                            self.guard.end()
                        last_ping = time.monotonic()
            except (psycopg.Error, DatabaseUnavailable) as exc:
                if self._stopping.is_set():
                    return
                log.warning("LISTEN connection lost (%s); reconnecting in %.1fs", exc, backoff,
                            extra={"action": "listen_error"})
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                close_quietly(conn)
