"""The supervisor: one claimer process per queue stripe, one maintenance process.

``awa-fast supervise app.module:app --queue email:stripes=2,concurrency=64``
forks its children (``multiprocess`` with the fork start method: nothing is
pickled), restarts a crashed child with exponential backoff, and turns
SIGTERM/SIGINT into a graceful drain: children stop claiming, hand back
unstarted jobs, let running handlers finish up to the drain timeout and
flush their batchers; whatever outlives the timeout is SIGKILLed.

Exit codes: 0 clean drain, 1 a child did not drain cleanly, 2 bad
configuration (for example the schema is not migrated), 3 database down.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from typing import Any

import multiprocess
import psycopg

from awa_fast import proctitle
from awa_fast.client import validate_name
from awa_fast.errors import AwaFastError, ConfigError, DatabaseUnavailable
from awa_fast.periodic import sync_app_schedules
from awa_fast.runtime.claimer import ClaimerConfig
from awa_fast.runtime.entry import claimer_main
from awa_fast.runtime.maintenance import MaintenanceConfig, maintenance_main
from awa_fast.storage import Storage, connect

log = logging.getLogger("awa_fast.supervisor")

EXIT_CLEAN, EXIT_UNCLEAN, EXIT_CONFIG, EXIT_DATABASE = 0, 1, 2, 3

_SPEC_KEYS = {"stripes": (1, 64), "concurrency": (1, 4096), "batch": (1, 10000)}


#: The largest claim an adaptive claimer grows to (a deep backlog of fast handlers).
ADAPTIVE_BATCH_MAX = 1024


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """How one queue is served: stripes (claimer processes), concurrency each, claim batch.

    ``stripes`` 0 means the queue's stored ``stripes`` setting (``queue_meta``,
    1 unless configured), read once at start by :func:`resolve_stripes`.
    ``batch`` is the most a claim takes and so the most jobs held locally
    beyond the running ones. 0 (the default) sizes claims from the backlog:
    from ``max(16, concurrency)`` up to :data:`ADAPTIVE_BATCH_MAX` while claims come back
    full, bounded by ~100 ms of handler work (``docs/performance.md``).
    """

    name: str
    stripes: int = 0
    concurrency: int = 64
    batch: int = 0

    @property
    def claim_batch(self) -> int:
        """The most one claim takes: ``batch``, or the adaptive ceiling when it is 0."""
        return self.batch or max(ADAPTIVE_BATCH_MAX, self.concurrency)

    @property
    def adaptive_batch(self) -> bool:
        """True when no ``batch`` was given: claims are sized from the backlog."""
        return self.batch == 0


def resolve_stripes(storage: Storage, conn: psycopg.Connection,
                    queues: tuple[QueueSpec, ...]) -> tuple[QueueSpec, ...]:
    """``queues`` with every unset stripe count (0) replaced by the queue's stored setting.

    The queues must exist (``Storage.queue_ensure``). One query, at start only.
    """
    if all(q.stripes for q in queues):
        return queues
    stored = {s["queue"]: int(s["stripes"]) for s in storage.queue_settings(conn)}
    return tuple(q if q.stripes else replace(q, stripes=max(1, stored.get(q.name, 1))) for q in queues)


def parse_queue_spec(text: str) -> QueueSpec:
    """Parse ``NAME[:stripes=N,concurrency=M,batch=B]``."""
    name, _, opts = text.partition(":")
    validate_name("queue", name)
    values: dict[str, int] = {}
    if opts:
        for part in opts.split(","):
            key, eq, raw = part.partition("=")
            key = key.strip()
            if not eq or key not in _SPEC_KEYS or not re.fullmatch(r"\d+", raw.strip()):
                raise ConfigError(f"bad queue option {part!r} in {text!r}: use "
                                  "NAME[:stripes=N,concurrency=M,batch=B]")
            low, high = _SPEC_KEYS[key]
            value = int(raw)
            if not low <= value <= high:
                raise ConfigError(f"{key}={value} in {text!r} is out of range {low}..{high}")
            values[key] = value
    return QueueSpec(name, **values)


def hide_dsn_password(dsn: str) -> bool:
    """Overwrite the password of ``dsn`` where it appears in this process's command line.

    ``/proc/<pid>/cmdline`` (what ``ps`` shows to every local user) reads the
    argument strings from the process's own memory, and forked children
    (claimers, maintenance) inherit that memory: a ``--dsn`` with a password
    would show in ``ps`` for each of them. The DSN argument is rewritten in
    place, its password as ``***`` (the whole DSN as ``***`` where the
    password is not written literally), before any child is forked. The
    password is visible from the start of the process until this runs:
    prefer ``AWA_FAST_DSN`` (``/proc/<pid>/environ`` is readable by the owner
    only) or a password in ``~/.pgpass``. Linux only; True if something was
    overwritten.
    """
    import ctypes

    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(dsn).get("password")
        password = None if given is None else str(given)
    except ProgrammingError:
        password = None
        secret = True  # unparseable: hide all of it
    else:
        secret = bool(password)
    if not secret:
        return False
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        with open("/proc/self/cmdline", "rb") as f:
            shown = f.read()
    except (OSError, ValueError, IndexError):
        return False
    if not 0 < start < end or ctypes.string_at(start, end - start) != shown:
        return False  # not the layout we know (a process title set by someone else): leave it
    raw = dsn.encode()
    masked = raw.replace(password.encode(), b"***") if password else b"***"
    if password:
        try:
            if conninfo_to_dict(masked.decode()).get("password") != "***":
                masked = b"***"
        except ProgrammingError:
            masked = b"***"
    args = shown.rstrip(b"\0").split(b"\0")
    changed = False
    for i, arg in enumerate(args):
        if raw in arg:
            args[i] = arg.replace(raw, masked)
            changed = True
    if not changed:
        return False
    new = b"\0".join(args)
    if len(new) >= len(shown):
        return False
    ctypes.memmove(start, new.ljust(len(shown), b"\0"), len(shown))
    return True


# The signals that ask a process to stop. A forked child starts with the supervisor's handlers for
# them (fork copies them): see _child_entry.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})

#: The signal that makes a child write every thread's Python stack to its stderr (the supervisor's
#: log): ``kill -USR1 <pid>`` shows where a claimer is; the supervisor sends it before a SIGKILL.
STACKS_SIGNAL = signal.SIGUSR1

# How long the supervisor gives a child to write its stacks before the SIGKILL (written by a C
# signal handler, even when every thread of the child is blocked: far less than this).
_STACKS_GRACE_S = 0.3


def _stop_before_start(signum: int, frame: Any) -> None:
    """A child's stop signal before the child installed its own handler: nothing is held yet, exit 0.

    In that window a claimer has claimed nothing and the maintenance process
    has done no maintenance, so there is nothing to drain: the drain is
    clean. (The default action, death by the signal, made a drain that came
    while a child was starting count as unclean: the supervisor exited 1.)
    """
    os._exit(0)


def _child_entry(target: Any, name: str) -> Any:
    """``target`` for a forked child: stop signals act on the child itself from its first instruction.

    The supervisor blocks the stop signals around the fork (``Supervisor._start``). The child sets
    them to :func:`_stop_before_start` before it unblocks them, so a SIGTERM that arrives before
    the child installs its own handler ends the child cleanly, instead of running the supervisor's
    drain in the child's copy (which would signal every sibling the copy knows of). A signal sent in
    that window is pending until the unblock and is never lost.
    """
    titled = proctitle.titled(target, name)

    def run(*args: Any, **kwargs: Any) -> Any:
        for sig in STOP_SIGNALS:
            signal.signal(sig, _stop_before_start)
        # a C-level handler: it writes the stacks even when the main thread never returns to Python
        with contextlib.suppress(AttributeError, ValueError, OSError, RuntimeError):  # stderr without a file
            faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return titled(*args, **kwargs)

    return run


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """Everything the supervisor needs to run its children."""

    app_ref: str
    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    queues: tuple[QueueSpec, ...]
    drain_timeout: float = 30.0
    restart_backoff_max: float = 10.0
    maintenance: bool = True
    poll_interval: float = 1.0
    heartbeat_interval: float = 5.0
    listen: bool = True  # False: poll only (e.g. behind a transaction-pooling proxy)
    io_timeout: float = 10.0  # an unanswered claim/flush/LISTEN ping this long means a dead connection
    home: str | None = None
    maintenance_config: dict[str, Any] = field(default_factory=dict)
    metrics: tuple[str, int] | None = None  # serve /metrics, /healthz, /readyz there (awa-fast[metrics])


@dataclass
class _Child:
    name: str
    target: Any
    args: tuple[Any, ...]
    process: Any = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = 0.1
    next_start: float = 0.0
    exitcode: int | None = None


class Supervisor:
    """Forks and watches the claimers and the maintenance process."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self._ctx = multiprocess.get_context("fork")
        self._draining = False
        self._children: list[_Child] = []
        self._ring: Any = None

    def request_drain(self, *_: object) -> None:
        """Start a graceful drain (signal handler): children are told at once.

        No I/O but the signals: the handler runs on the main thread between
        two bytecodes, maybe inside a log write to the same stream (a
        buffered stream refuses a re-entrant write). ``_drain`` logs it.
        """
        if self._draining:
            return
        self._draining = True
        self._signal_children(signal.SIGTERM)

    def _signal_children(self, sig: int) -> None:
        for child in self._children:
            proc = child.process
            if proc is not None and proc.pid is not None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def _prepare_database(self) -> None:
        storage = Storage(self.config.schema)
        conn = connect(self.config.dsn, application_name="awa_fast:supervisor")
        try:
            storage.schema_check(conn)
            if storage.server_wal_level(conn) == "minimal":
                raise ConfigError("wal_level=minimal can rewind a new lane's cursor sequence after a crash "
                                  "(jobs stranded or enqueued twice): set wal_level=replica and restart PostgreSQL")
            for q in self.config.queues:
                storage.queue_ensure(conn, q.name)
            self.config = replace(self.config, queues=resolve_stripes(storage, conn, self.config.queues))
            sync_app_schedules(conn, storage, self.config.app_ref)  # declared periodic jobs -> schedules
        finally:
            conn.close()

    def run(self) -> int:
        """Run until drained; returns the process exit code."""
        cfg = self.config
        # A title (with setproctitle) replaces the whole command line; without one the password is masked.
        proctitle.set_title(f"supervisor {cfg.app_ref}")
        if hide_dsn_password(cfg.dsn):
            log.info("the DSN's password is overwritten in this process's command line; pass the DSN in "
                     "AWA_FAST_DSN or keep the password in ~/.pgpass instead of --dsn",
                     extra={"action": "dsn_hidden"})
        try:
            self._prepare_database()
        except DatabaseUnavailable as exc:
            log.error("%s", exc, extra={"action": "supervisor_exit"})
            return EXIT_DATABASE
        except AwaFastError as exc:
            log.error("%s", exc, extra={"action": "supervisor_exit"})
            return EXIT_CONFIG
        cfg = self.config  # stripe counts resolved against the stored settings
        slots = [(q.name, i) for q in cfg.queues for i in range(q.stripes)]
        shm_name = self._create_ring(slots)
        index = 0
        for q in cfg.queues:
            for stripe in range(q.stripes):
                ccfg = ClaimerConfig(cfg.dsn, cfg.schema, q.name, stripe, q.stripes, q.concurrency, q.claim_batch,
                                     cfg.poll_interval, heartbeat_interval=cfg.heartbeat_interval,
                                     drain_timeout=cfg.drain_timeout, listen=cfg.listen,
                                     io_timeout=cfg.io_timeout, adaptive_batch=q.adaptive_batch)
                self._children.append(_Child(f"claimer {q.name}#{stripe}", claimer_main,
                                             (cfg.app_ref, ccfg, shm_name, index)))
                index += 1
        if cfg.maintenance:
            mcfg = MaintenanceConfig(cfg.dsn, cfg.schema, **cfg.maintenance_config)
            self._children.append(_Child("maintenance", maintenance_main, (mcfg, shm_name)))
        if cfg.metrics is not None and shm_name is not None:
            from awa_fast.metrics import metrics_main

            self._children.append(_Child("metrics", metrics_main, (shm_name, cfg.metrics, cfg.dsn, cfg.schema,
                                                                   cfg.home)))
        signal.signal(signal.SIGTERM, self.request_drain)
        signal.signal(signal.SIGINT, self.request_drain)
        log.info("supervisor %d starting %d claimers and %s", os.getpid(), len(slots),
                 "maintenance" if cfg.maintenance else "no maintenance", extra={"action": "supervisor_start"})
        try:
            for child in self._children:
                self._start(child)
            self._watch()
            return self._drain()
        finally:
            self._close_ring()

    def _create_ring(self, slots: list[tuple[str, int]]) -> str | None:
        try:
            from awa_fast.runtime.shm import ShmRing, sweep_dead_segments, write_locator
        except ImportError:
            return None
        # A supervisor killed with SIGKILL (its resource tracker too) leaves its segment behind:
        # remove those whose owner is provably dead (each one logged at INFO), never a live one's.
        try:
            sweep_dead_segments()
        except Exception:  # noqa: BLE001 - housekeeping must never stop a start
            log.warning("sweeping shared-memory segments of dead supervisors failed", exc_info=True,
                        extra={"action": "shm_sweep_failed"})
        self._ring = ShmRing.create(None, slots)
        if self.config.home:
            write_locator(self.config.home, self.config.schema, self._ring.name, os.getpid())
        return str(self._ring.name)

    def _close_ring(self) -> None:
        if self._ring is None:
            return
        if self.config.home:
            from awa_fast.runtime.shm import remove_locator

            remove_locator(self.config.home, self.config.schema, self._ring.name)
        self._ring.close()
        self._ring.unlink()
        self._ring = None

    def _start(self, child: _Child) -> None:
        proc = self._ctx.Process(target=_child_entry(child.target, child.name), args=child.args,
                                 name=child.name, daemon=False)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            proc.start()  # the child unblocks them once its handlers are its own (_child_entry)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.process = proc
        child.started = time.monotonic()
        log.info("started %s (pid %d)", child.name, proc.pid, extra={"action": "child_start"})

    def _watch(self) -> None:
        while not self._draining:
            live = [c.process.sentinel for c in self._children if c.process is not None]
            now = time.monotonic()
            pending = [c.next_start - now for c in self._children if c.process is None]
            timeout = max(0.01, min([0.5, *pending]))
            if not live:
                time.sleep(timeout)  # no child to wait on: only the restart schedule
            ready = wait(live, timeout) if live else []
            now = time.monotonic()
            for child in self._children:
                proc = child.process
                if proc is not None and proc.sentinel in ready:
                    proc.join()
                    child.exitcode = proc.exitcode
                    child.process = None
                    if self._draining:
                        break
                    lived = now - child.started
                    child.backoff = 0.1 if lived > 30 else min(child.backoff * 2, self.config.restart_backoff_max)
                    child.next_start = now + child.backoff
                    child.restarts += 1
                    log.warning("%s exited with code %s after %.1fs; restarting in %.1fs",
                                child.name, proc.exitcode, lived, child.backoff, extra={"action": "child_exit"})
                elif proc is None and now >= child.next_start and not self._draining:
                    self._start(child)

    def _drain(self) -> int:
        deadline = time.monotonic() + self.config.drain_timeout + 5.0
        log.info("drain requested", extra={"action": "drain_requested"})
        self._signal_children(signal.SIGTERM)
        clean = True
        for child in self._children:
            proc = child.process
            if proc is None:
                continue
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("%s did not drain within the timeout; its threads' stacks follow; SIGKILL", child.name,
                          extra={"action": "child_kill"})
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, STACKS_SIGNAL)
                    proc.join(_STACKS_GRACE_S)  # it does not exit: the time its handler takes to write them
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join()
                clean = False
            elif proc.exitcode != 0:
                clean = False
            log.info("%s exited with code %s", child.name, proc.exitcode, extra={"action": "child_exit"})
        log.info("supervisor drained (%s)", "clean" if clean else "unclean", extra={"action": "supervisor_exit"})
        return EXIT_CLEAN if clean else EXIT_UNCLEAN

    def children(self) -> list[tuple[str, int | None]]:
        """(name, pid) of every child (pid None while waiting for a restart)."""
        return [(c.name, c.process.pid if c.process is not None else None) for c in self._children]


__all__ = ["QueueSpec", "Supervisor", "SupervisorConfig", "hide_dsn_password", "parse_queue_spec", "replace"]
