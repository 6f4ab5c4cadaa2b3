"""The listener of one claimer: LISTEN/NOTIFY wake-ups read on the claim thread itself.

Producers notify the schema's channel with the queue name when a lane's
backlog is short (see ``job_enqueue`` in the migrations); a notification
for this claimer's queue wakes its claim loop. The claim loop sleeps in
:meth:`Listener.wait`: one ``select`` on the LISTEN connection's socket and
on its own :class:`Wakeup`, so a NOTIFY wakes the thread that claims, with
no thread hop in between.

The LISTEN connection is opened (and ``LISTEN`` run on it) by a helper
thread, ``awa-listen``, which hands it over to the claim thread and from
then on never touches it: a connect to a silent peer may block for its
``connect_timeout``, and the claim loop must go on polling meanwhile. After
every hand-over the claim loop claims once, since notifications may have
been missed while the connection was down. The claim thread reads the
connection without blocking (libpq ``consume_input``) and pings it with an
empty query every ``io_timeout / 2`` while it waits: a half-open socket
delivers neither a notification nor an error, and only an answer proves it
alive. A ping without an answer for ``io_timeout``, an error, or a closed
socket makes the claim thread close the connection and ask the helper for a
new one (with backoff); it never waits on the LISTEN connection itself.
The watchdog guards the one blocking statement left, the ``LISTEN`` on the
helper thread, through this listener's
:class:`~awa_fast.runtime.watchdog.IoGuard`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import pq

from awa_fast.errors import DatabaseUnavailable
from awa_fast.runtime.stopflag import StopFlag, wait_readable
from awa_fast.runtime.watchdog import IoGuard
from awa_fast.storage import Storage, close_quietly, connect

log = logging.getLogger("awa_fast.claimer")

_BACKOFF_FIRST = 0.1
_BACKOFF_MAX = 5.0


class Wakeup(StopFlag):
    """A :class:`~awa_fast.runtime.stopflag.StopFlag` that its one waiting thread clears, and can ``select()`` on.

    ``set`` may be called from any thread and from a signal handler (it takes
    no lock); ``clear`` and the waits belong to one thread (the claim thread;
    for the in-process worker's kick, the thread in ``Worker.wait``). A
    ``set`` that lands before a ``clear`` is consumed by it, as with an
    ``Event``: the claim loop clears first and then looks at what it was
    woken for.
    """

    __slots__ = ()

    def fileno(self) -> int:
        """The read end: readable while a wake-up is pending."""
        return self._r

    def clear(self) -> None:
        self._flag = False
        try:
            while os.read(self._r, 512):
                pass
        except OSError:  # empty
            pass


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """Listener settings."""

    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    queue: str
    io_timeout: float = 10.0


class Listener:
    """The LISTEN connection of one claim loop: opened on a helper thread, read and pinged on the claim thread."""

    def __init__(self, config: ListenerConfig, stopping: StopFlag) -> None:
        self.config = config
        self.storage = Storage(config.schema)
        self.guard = IoGuard("LISTEN")
        self._stopping = stopping
        self._wake: Wakeup | None = None  # the claim loop's, given to start()
        self._lock = threading.Lock()  # guards the hand-over slot and _closed
        self._fresh: psycopg.Connection | None = None  # opened by the helper, not yet taken by the claim thread
        self._closed = False
        self._need = threading.Event()  # the claim thread wants a (new) connection
        self._need.set()
        self._thread = threading.Thread(target=self._connect_loop, name="awa-listen", daemon=True)
        # The claim thread's state (only it reads or writes these):
        self._conn: psycopg.Connection | None = None
        self._payload = config.queue.encode()
        self._ping_every = max(0.5, config.io_timeout / 2)
        self._ping_sent: float | None = None  # monotonic time of the ping in flight
        self._answered = 0.0  # monotonic time of the last answer (or of the hand-over)

    @property
    def backend_pid(self) -> int | None:
        """The server process of the LISTEN connection the claim thread holds now (None: none yet, or lost)."""
        conn = self._conn
        return None if conn is None or conn.closed else conn.info.backend_pid

    def start(self, wake: Wakeup) -> None:
        self._wake = wake
        self._thread.start()

    def close(self) -> None:
        """The claim loop has ended: close the connection, end the helper thread (claim thread)."""
        with self._lock:
            self._closed = True
            fresh, self._fresh = self._fresh, None
        self._need.set()
        close_quietly(fresh)
        self._drop(None)
        if self._thread.ident is not None:
            self._thread.join(1.0)

    # -- the helper thread: connect and LISTEN --------------------------------------------

    def _connect_loop(self) -> None:
        cfg = self.config
        backoff = _BACKOFF_FIRST
        pause = 0.0  # before the next connect: none at first, backoff after a failure or a loss
        while True:
            self._need.wait()
            if pause:
                self._stopping.wait(pause)
            if self._stopping.is_set() or self._closed:
                return
            conn: psycopg.Connection | None = None
            try:
                conn = connect(cfg.dsn, application_name=f"awa_fast:listen:{cfg.queue}",
                               connect_timeout=int(cfg.io_timeout + 0.999))
                self.guard.begin(conn)
                try:
                    self.storage.channel_listen(conn)
                finally:
                    self.guard.end()
                conn.pgconn.nonblocking = 1  # from here on only the claim thread's non-blocking reads
            except (psycopg.Error, DatabaseUnavailable) as exc:
                close_quietly(conn)
                if self._stopping.is_set():
                    return
                log.warning("LISTEN connection failed (%s); reconnecting in %.1fs", exc, backoff,
                            extra={"action": "listen_error"})
                pause, backoff = backoff, min(backoff * 2, _BACKOFF_MAX)
                continue
            pause = backoff = _BACKOFF_FIRST
            with self._lock:
                if self._closed:
                    close_quietly(conn)
                    return
                self._need.clear()
                self._fresh = conn
            if self._wake is not None:
                self._wake.set()  # the claim loop takes it over and claims once

    # -- the claim thread ----------------------------------------------------------------

    def wait(self, wake: Wakeup, timeout: float) -> bool:
        """Sleep until ``wake`` is set, a NOTIFY for this queue arrives, or ``timeout``; True on a NOTIFY.

        Also True when a fresh LISTEN connection was taken over (wake-ups may
        have been missed while there was none). Runs on the claim thread only.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self._fresh is not None and self._adopt():
                return True
            conn = self._conn
            if conn is not None and self._poll(conn):
                return True
            if wake.is_set():
                return False
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return False
            conn = self._conn
            if conn is None:
                wake.wait(left)
                continue
            if self._ping_sent is None:
                left = min(left, max(0.0, self._answered + self._ping_every - now))
            else:
                left = min(left, max(0.0, self._ping_sent + self.config.io_timeout - now) + 0.005)
            try:
                wait_readable((wake.fileno(), conn.pgconn.socket), left)
            except (OSError, ValueError, psycopg.Error) as exc:  # a closed socket
                self._drop(exc)

    def _adopt(self) -> bool:
        with self._lock:
            conn, self._fresh = self._fresh, None
        if conn is None:
            return False
        self._drop(None)
        self._conn = conn
        self._ping_sent = None
        self._answered = time.monotonic()
        return True

    def _poll(self, conn: psycopg.Connection) -> bool:
        """Read what has arrived on the LISTEN connection without blocking; ping it when due.

        True if a NOTIFY for this queue was among it. A broken connection, or a
        ping unanswered for ``io_timeout``, is closed and a new one asked for.
        """
        pg = conn.pgconn
        notified = False
        try:
            pg.consume_input()
            while (note := pg.notifies()) is not None:
                if note.extra == self._payload:
                    notified = True
            now = time.monotonic()
            if self._ping_sent is not None:
                while not pg.is_busy():
                    res = pg.get_result()
                    if res is None:  # the ping's answer is complete
                        self._ping_sent = None
                        self._answered = now
                        break
                    if res.status != pq.ExecStatus.EMPTY_QUERY:
                        detail = res.error_message.decode(errors="replace").strip()
                        raise psycopg.OperationalError(f"LISTEN ping failed: {detail}")
                else:
                    if now - self._ping_sent > self.config.io_timeout:
                        log.error("LISTEN ping has had no answer for %.0fs: closing its connection",
                                  now - self._ping_sent, extra={"action": "io_timeout"})
                        raise psycopg.OperationalError("LISTEN ping unanswered")
            if pg.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError("LISTEN connection closed")
            if self._ping_sent is None and now - self._answered >= self._ping_every:
                pg.send_query(b"")  # an empty query: a round trip that runs no statement
                pg.flush()
                self._ping_sent = now
        except psycopg.Error as exc:
            self._drop(exc)
            return True  # claim once: a NOTIFY may have been lost with the connection
        return notified

    def _drop(self, exc: BaseException | None) -> None:
        """Close the LISTEN connection (claim thread) and, unless stopping, ask the helper for a new one."""
        conn, self._conn = self._conn, None
        self._ping_sent = None
        if conn is None:
            return
        close_quietly(conn)
        if exc is not None and not self._stopping.is_set():
            log.warning("LISTEN connection lost (%s); reconnecting", str(exc).strip().splitlines()[0] if str(exc)
                        else type(exc).__name__, extra={"action": "listen_error"})
        if not self._closed:
            self._need.set()
