"""A small TCP proxy between awa-fast processes and PostgreSQL, with switchable faults.

There is no ``tc netem`` and no ``iptables`` on these machines, so network
faults are made here: an asyncio proxy in a background thread, listening on
``127.0.0.1`` on an ephemeral port, forwarding to one upstream PostgreSQL.

Modes (switch at any time, from any thread):

- ``pass``: forward everything.
- ``drop``: close every connection (both sides) now and refuse new ones
  (accepted, then closed at once) until the mode changes; with ``match``,
  only connections whose ``application_name`` matches.
- ``blackhole``: keep the client socket open and forward nothing, in either
  direction. The server side of a blackholed connection is closed (its
  backend ends, locks go), so the client holds a *half-open* connection:
  it believes the server is there, nothing will ever answer. A blackholed
  connection stays dead after the mode changes back (a middlebox that lost
  the connection's state); new connections work again. ``match`` limits the
  blackhole to connections whose ``application_name`` matches (parsed from
  the startup message), e.g. only the claimer and the listener.
- ``delay``: every chunk is held ``delay_ms`` plus a uniform jitter of
  ``+-jitter_ms`` (order within a connection preserved).
- ``lose_ack``: one-shot, per matching connection: when the client sends a
  message containing ``trigger`` (e.g. ``b"COMMIT"``), it is forwarded, every
  later server-to-client byte is swallowed, and the connection is closed
  ``close_after`` seconds later. The statement runs on the server (a COMMIT
  commits), the client never learns it and sees a broken connection.

The proxy never connects anywhere but its one upstream, listens on loopback
only, caps its connections, and stops by itself after ``max_lifetime``
seconds. Client DSNs must use ``sslmode=disable`` (see :meth:`dsn`) so the
startup message, and with it ``application_name``, is readable.

The proxy does not authenticate anyone: it forwards the client's SCRAM
exchange to the upstream, which (PostgresCluster, TCP) asks for the
cluster's password. Any local user can reach the proxy's port, so the
upstream must never trust TCP; :meth:`dsn` names the password file
(``passfile``) given to the constructor, never the password.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_CANCEL_REQUEST = 80877102


@dataclass
class _Conn:
    cid: int
    client_r: asyncio.StreamReader
    client_w: asyncio.StreamWriter
    server_r: asyncio.StreamReader | None = None
    server_w: asyncio.StreamWriter | None = None
    app: str = ""
    blackholed: bool = False
    ack_lost: bool = False
    closed: bool = False
    opened_at: float = field(default_factory=time.monotonic)
    tasks: list[asyncio.Task] = field(default_factory=list)


@dataclass
class _LoseAck:
    match: Callable[[str], bool]
    trigger: tuple[bytes, ...]
    close_after: float
    remaining: int
    fired: list[tuple[int, str, float]] = field(default_factory=list)


class ChaosProxy:
    """A fault-injecting TCP proxy in front of one PostgreSQL server."""

    def __init__(self, upstream_host: str, upstream_port: int, *, max_connections: int = 400,
                 max_lifetime: float = 900.0, passfile: str | None = None) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.passfile = passfile
        self.max_connections = max_connections
        self.max_lifetime = max_lifetime
        self.port = 0
        self.mode = "pass"
        self.delay_ms = 0.0
        self.jitter_ms = 0.0
        self._blackhole_match: Callable[[str], bool] | None = None
        self._drop_match: Callable[[str], bool] | None = None
        self._lose_ack: list[_LoseAck] = []
        self._conns: dict[int, _Conn] = {}
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self.stats = {"accepted": 0, "refused": 0, "blackholed": 0, "dropped": 0, "acks_lost": 0}
        self._rng = random.Random(0x5EED)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> ChaosProxy:
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("chaos proxy did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ChaosProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def dsn(self, **extra: object) -> str:
        """A libpq conninfo that reaches the upstream through this proxy."""
        from psycopg.conninfo import make_conninfo

        parts: dict[str, object] = {"host": "127.0.0.1", "port": self.port, "user": "postgres",
                                    "dbname": "postgres", "sslmode": "disable", "gssencmode": "disable"}
        if self.passfile is not None:
            parts["passfile"] = self.passfile
        return make_conninfo("", **{**parts, **extra})

    # -- switching modes (thread-safe) ----------------------------------------------

    def set_pass(self) -> None:
        self._call(self._set_mode, "pass")

    def drop_all(self, match: str | Callable[[str], bool] | None = None) -> None:
        """Close every connection (or those whose application_name matches) now and refuse
        new ones (matching ones) until another mode is set."""
        self._call(self._set_drop, None if match is None else _predicate(match))

    def blackhole(self, match: str | Callable[[str], bool] | None = None) -> None:
        """Blackhole every connection (``match=None``) or those whose application_name matches."""
        pred = _predicate(match)
        self._call(self._set_blackhole, pred)

    def delay(self, delay_ms: float, jitter_ms: float = 0.0) -> None:
        self.delay_ms = float(delay_ms)
        self.jitter_ms = float(jitter_ms)
        self._call(self._set_mode, "delay")

    def lose_ack(self, match: str | Callable[[str], bool], trigger: bytes | tuple[bytes, ...] = b"COMMIT", *,
                 close_after: float = 0.3, count: int = 1) -> _LoseAck:
        """Arm a one-shot (``count`` times) lost acknowledgement; returns its record (``.fired``).

        ``trigger``: bytes (or a tuple of alternatives) that the client's message must contain.
        """
        rule = _LoseAck(_predicate(match), trigger if isinstance(trigger, tuple) else (trigger,), close_after, count)
        self._call(self._lose_ack.append, rule)
        return rule

    def connections(self) -> list[tuple[int, str, bool]]:
        """(id, application_name, blackholed) of every open connection."""
        return [(c.cid, c.app, c.blackholed) for c in list(self._conns.values()) if not c.closed]

    def _call(self, fn: Callable, *args: object) -> None:  # type: ignore[type-arg]
        loop = self._loop
        if loop is None:
            raise RuntimeError("proxy not started")

        async def run() -> None:
            fn(*args)

        asyncio.run_coroutine_threadsafe(run(), loop).result(10)

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        self._blackhole_match = None
        self._drop_match = None

    def _set_drop(self, pred: Callable[[str], bool] | None) -> None:
        self._set_mode("drop")
        self._drop_match = pred
        for c in list(self._conns.values()):
            if pred is None or pred(c.app):
                self.stats["dropped"] += 1
                self._close(c)

    def _set_blackhole(self, pred: Callable[[str], bool]) -> None:
        self.mode = "blackhole"
        self._blackhole_match = pred
        for c in list(self._conns.values()):
            if pred(c.app):
                self._hole(c)

    # -- the event loop ---------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.close()
            self._stopped.set()

    async def _main(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, backlog=256)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await asyncio.wait_for(self._server.serve_forever(), self.max_lifetime)
        except (TimeoutError, asyncio.CancelledError):
            pass
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns.values()):
            self._close(c)
        self._conns.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (self.mode == "drop" and self._drop_match is None) or len(self._conns) >= self.max_connections:
            self.stats["refused"] += 1
            writer.transport.abort()
            return
        self._next += 1
        conn = _Conn(self._next, reader, writer)
        self._conns[conn.cid] = conn
        self.stats["accepted"] += 1
        if self.mode == "blackhole" and self._blackhole_match is not None and self._blackhole_match(""):
            # match-all blackhole: new connections are dead from the start
            self._hole(conn)
            return
        try:
            startup = await self._read_startup(conn)
        except (OSError, asyncio.IncompleteReadError, ConnectionError, RuntimeError, struct.error):
            self._close(conn)
            return
        if conn.closed or conn.blackholed:
            return
        if self.mode == "blackhole" and self._blackhole_match is not None and self._blackhole_match(conn.app):
            self._hole(conn)
            return
        if self.mode == "drop" and (self._drop_match is None or self._drop_match(conn.app)):
            self.stats["refused"] += 1
            self._close(conn)
            return
        try:
            conn.server_r, conn.server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._close(conn)
            return
        conn.server_w.write(startup)
        conn.tasks.append(asyncio.ensure_future(self._pump(conn, conn.client_r, True)))
        conn.tasks.append(asyncio.ensure_future(self._pump(conn, conn.server_r, False)))

    async def _read_startup(self, conn: _Conn) -> bytes:
        """Read the startup message (answering an SSL/GSS request with 'N'); returns its bytes."""
        while True:
            head = await conn.client_r.readexactly(8)
            length, code = struct.unpack("!II", head)
            if length == 8 and code in (_SSL_REQUEST, _GSS_REQUEST):
                conn.client_w.write(b"N")
                await conn.client_w.drain()
                continue
            body = await conn.client_r.readexactly(length - 8)
            if code != _CANCEL_REQUEST:
                fields = body.split(b"\x00")
                params = dict(zip(fields[0::2], fields[1::2]))
                conn.app = params.get(b"application_name", b"").decode("utf-8", "replace")
            return head + body

    async def _pump(self, conn: _Conn, reader: asyncio.StreamReader, upstream: bool) -> None:
        """Forward one direction: client->server when ``upstream``, else server->client."""
        due = 0.0
        try:
            while not conn.closed:
                data = await reader.read(65536)
                if not data:
                    break
                if conn.blackholed:
                    continue
                if not upstream and conn.ack_lost:
                    continue
                if self.mode == "delay" and (self.delay_ms or self.jitter_ms):
                    hold = max(0.0, self.delay_ms + self._rng.uniform(-self.jitter_ms, self.jitter_ms)) / 1000
                    due = max(due, time.monotonic() + hold)
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    if conn.closed or conn.blackholed:
                        break
                if upstream and self._lose_ack:
                    self._check_lose_ack(conn, data)  # before forwarding: the answer must not slip through
                writer = conn.server_w if upstream else conn.client_w
                assert writer is not None
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError, asyncio.IncompleteReadError, AssertionError):
            pass
        if not conn.blackholed:
            self._close(conn)

    def _check_lose_ack(self, conn: _Conn, data: bytes) -> None:
        for rule in self._lose_ack:
            if rule.remaining > 0 and any(t in data for t in rule.trigger) and rule.match(conn.app):
                rule.remaining -= 1
                rule.fired.append((conn.cid, conn.app, time.monotonic()))
                conn.ack_lost = True
                self.stats["acks_lost"] += 1
                asyncio.get_running_loop().call_later(rule.close_after, self._close, conn)
                return

    def _hole(self, conn: _Conn) -> None:
        if conn.blackholed or conn.closed:
            return
        conn.blackholed = True
        self.stats["blackholed"] += 1
        # the server side goes away (its backend ends); the client side stays open and silent
        if conn.server_w is not None:
            conn.server_w.transport.abort()
        # keep draining the client so its writes never block: read and discard
        # (an established connection's client pump already does that)
        if conn.server_w is None:
            conn.tasks.append(asyncio.ensure_future(self._discard(conn)))

    async def _discard(self, conn: _Conn) -> None:
        try:
            while not conn.closed:
                if not await conn.client_r.read(65536):
                    break
        except (OSError, ConnectionError, RuntimeError):
            pass

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for w in (conn.client_w, conn.server_w):
            if w is not None:
                w.transport.abort()
        for t in conn.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self._conns.pop(conn.cid, None)


def _predicate(match: str | Callable[[str], bool] | None) -> Callable[[str], bool]:
    if match is None:
        return lambda app: True
    if callable(match):
        return match
    rx = re.compile(match)
    return lambda app: bool(app) and rx.search(app) is not None
