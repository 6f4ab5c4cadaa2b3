"""Unique jobs: at most one job per key in a holding state.

``Unique(by_args=True, by_queue=False, period=None, states=None, key=None)``
on ``@app.job(unique=...)`` (the kind's default) or on ``enqueue`` /
``enqueue_many``. The key is a SHA-256 over the kind and the canonical JSON
of the args (keys sorted), plus the queue when ``by_queue``; ``key=`` replaces
all of that with your own string (so it can span kinds). ``period`` (seconds)
buckets the key by the database clock: ``floor(epoch / period)``, so
``period=3600`` is "one per clock hour".

Storage (migration 0005): ``unique_keys`` maps a key to the job holding it.
A conflicting enqueue reads the holder's state; if the holder has left the
holding states (by default scheduled, available, running, retryable,
waiting for a callback, snoozed) it takes the key over, otherwise it raises
:class:`UniqueConflict` (``enqueue``) or skips the row (``enqueue_many``).
Completion never touches the key: release is lazy, and the maintenance
leader sweeps stale keys in batches (:func:`sweep_once`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
import psycopg

from awa_fast.errors import AwaFastError, ConfigError

if TYPE_CHECKING:
    from awa_fast.storage import Storage

log = logging.getLogger("awa_fast.unique")

#: Bits of the holding-state mask (sql/0011_periodic_unique.sql, unique_state_bit).
STATE_BITS: dict[str, int] = {
    "scheduled": 1, "available": 2, "running": 4, "retryable": 8, "waiting_external": 16, "snoozed": 32,
    "completed": 64, "failed": 128, "cancelled": 256, "dlq": 512,
}
_ALIASES = {"waiting": "waiting_external", "waiting_for_callback": "waiting_external"}
#: States that hold a key unless ``states=`` says otherwise: every state from which the job can still run.
DEFAULT_STATES: tuple[str, ...] = ("scheduled", "available", "running", "retryable", "waiting_external", "snoozed")
MAX_PERIOD_S = 366 * 86400.0


class UniqueConflict(AwaFastError):
    """A unique job's key is held by another job in a holding state; nothing was enqueued.

    ``existing_job_id`` is the holder. The caller's transaction is still usable.
    """

    def __init__(self, existing_job_id: int, kind: str | None = None) -> None:
        self.existing_job_id = existing_job_id
        self.kind = kind
        what = f"a {kind!r} job" if kind else "a job"
        super().__init__(f"{what} with this unique key is already held by job {existing_job_id}; "
                         "nothing was enqueued")


@dataclass(frozen=True, slots=True)
class Unique:
    """How a job's unique key is formed and which states hold it.

    - ``by_args``: the key covers the canonical args (False: one per kind).
    - ``by_queue``: the key also covers the queue.
    - ``period``: seconds; the key is bucketed by ``floor(now / period)`` on the database clock.
    - ``states``: the states that hold the key (default :data:`DEFAULT_STATES`); add
      ``completed`` (etc.) to keep a finished job's key for the rest of its period.
    - ``key``: your own key string; replaces kind, args and queue in the hash.
    """

    by_args: bool = True
    by_queue: bool = False
    period: float | None = None
    states: tuple[str, ...] | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if self.period is not None:
            p = self.period
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 1 <= p <= MAX_PERIOD_S:
                raise ConfigError(f"Unique(period={p!r}): use seconds between 1 and {MAX_PERIOD_S:.0f}")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise ConfigError(f"Unique(key={self.key!r}): use a non-empty string")
        if self.states is not None:
            if isinstance(self.states, str):
                raise ConfigError("Unique(states=...) takes a sequence of state names, not one string")
            object.__setattr__(self, "states", tuple(self.states))
            self.mask  # noqa: B018 - validates the names

    @property
    def mask(self) -> int:
        """The holding-state bit mask stored with the key."""
        names = DEFAULT_STATES if self.states is None else self.states
        mask = 0
        for name in names:
            bit = STATE_BITS.get(_ALIASES.get(name, name))
            if bit is None:
                raise ConfigError(f"Unique(states=...): unknown state {name!r}; use {sorted(STATE_BITS)}")
            mask |= bit
        if not mask:
            raise ConfigError("Unique(states=()) would hold nothing; leave states=None for the default")
        return mask

    def key_for(self, kind: str, args_json: bytes, queue: str) -> bytes:
        """The 32-byte key of one job (before the period bucket, which the database adds)."""
        if self.key is not None:
            material: dict[str, Any] = {"key": self.key}
        else:
            material = {"kind": kind}
            if self.by_args:
                material["args"] = orjson.Fragment(canonical_json(args_json))
            if self.by_queue:
                material["queue"] = queue
        return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).digest()


def canonical_json(args_json: bytes) -> bytes:
    """Args re-encoded with sorted keys at every level (so ``{"a":1,"b":2}`` equals ``{"b":2,"a":1}``)."""
    return orjson.dumps(orjson.loads(args_json), option=orjson.OPT_SORT_KEYS)


def dedupe(keys: Sequence[bytes]) -> list[int]:
    """Indexes of the first occurrence of each key (duplicates within one batch are skipped)."""
    seen: set[bytes] = set()
    keep = []
    for i, k in enumerate(keys):
        if k not in seen:
            seen.add(k)
            keep.append(i)
    return keep


class UniqueManyResult(int):
    """What ``enqueue_many(..., unique=...)`` did: an ``int`` (rows inserted) with details.

    ``inserted`` and ``skipped`` (duplicates within the batch or held by
    another job) add up to the rows given; ``job_ids`` are the new jobs.
    """

    inserted: int
    skipped: int
    job_ids: list[int]

    def __new__(cls, inserted: int, skipped: int, job_ids: Iterable[int] = ()) -> UniqueManyResult:
        obj = super().__new__(cls, inserted)
        obj.inserted = inserted
        obj.skipped = skipped
        obj.job_ids = list(job_ids)
        return obj

    def __repr__(self) -> str:
        return f"UniqueManyResult(inserted={self.inserted}, skipped={self.skipped})"


# -- enqueue (called by awa_fast.client when unique= is given) -------------------------------


def _check(unique: Any) -> Unique:
    if not isinstance(unique, Unique):
        raise ConfigError(f"unique={unique!r}: pass awa_fast.Unique(...) (or None/False for none)")
    return unique


def enqueue_one(storage: Storage, conn: psycopg.Connection, unique: Any, queue: str, priority: int, kind: str,
                args: Any, metadata: Any, max_attempts: int, run_at: Any, delay: float | None) -> int:
    """Enqueue one unique job; raise :class:`UniqueConflict` (nothing written) if its key is held."""
    u = _check(unique)
    job, inserted = storage.job_enqueue_unique(conn, u.key_for(kind, bytes(args), queue), u.period, u.mask,
                                               queue, priority, kind, args, metadata, max_attempts, run_at, delay)
    if not inserted:
        raise UniqueConflict(job, kind)
    return job


async def enqueue_one_async(storage: Storage, conn: psycopg.AsyncConnection, unique: Any, queue: str, priority: int,
                            kind: str, args: Any, metadata: Any, max_attempts: int, run_at: Any,
                            delay: float | None) -> int:
    """Async twin of :func:`enqueue_one`."""
    u = _check(unique)
    job, inserted = await storage.job_enqueue_unique_async(
        conn, u.key_for(kind, bytes(args), queue), u.period, u.mask, queue, priority, kind, args, metadata,
        max_attempts, run_at, delay)
    if not inserted:
        raise UniqueConflict(job, kind)
    return job


def _plan(u: Unique, kind: str, payloads: Sequence[Any], queue: str) -> tuple[list[bytes], list[int]]:
    keys = [u.key_for(kind, bytes(a), queue) for a in payloads]
    return keys, dedupe(keys)


def enqueue_many(storage: Storage, conn: psycopg.Connection, unique: Any, queue: str, priority: int, kind: str,
                 payloads: Sequence[Any], metadata: Any, max_attempts: int, chunk: int,
                 progress: Any) -> UniqueManyResult:
    """Enqueue unique jobs, skipping duplicates within ``payloads`` and keys held by other jobs."""
    import contextlib

    u = _check(unique)
    keys, keep = _plan(u, kind, payloads, queue)
    ids: list[int] = []
    done = 0
    scope = conn.transaction() if conn.autocommit else contextlib.nullcontext()
    with scope:
        for start in range(0, len(keep), chunk):
            part = keep[start:start + chunk]
            rows = storage.job_enqueue_unique_many(conn, [keys[i] for i in part], u.period, u.mask, queue,
                                                   priority, kind, [payloads[i] for i in part], metadata,
                                                   max_attempts)
            ids.extend(j for j, inserted in rows if inserted)
            done += len(part)
            if progress is not None:
                progress(done)
    return UniqueManyResult(len(ids), len(payloads) - len(ids), ids)


async def enqueue_many_async(storage: Storage, conn: psycopg.AsyncConnection, unique: Any, queue: str, priority: int,
                             kind: str, payloads: Sequence[Any], metadata: Any, max_attempts: int, chunk: int,
                             progress: Any) -> UniqueManyResult:
    """Async twin of :func:`enqueue_many`."""
    import contextlib

    u = _check(unique)
    keys, keep = _plan(u, kind, payloads, queue)
    ids: list[int] = []
    done = 0
    scope = conn.transaction() if conn.autocommit else contextlib.nullcontext()
    async with scope:
        for start in range(0, len(keep), chunk):
            part = keep[start:start + chunk]
            rows = await storage.job_enqueue_unique_many_async(
                conn, [keys[i] for i in part], u.period, u.mask, queue, priority, kind,
                [payloads[i] for i in part], metadata, max_attempts)
            ids.extend(j for j, inserted in rows if inserted)
            done += len(part)
            if progress is not None:
                progress(done)
    return UniqueManyResult(len(ids), len(payloads) - len(ids), ids)


# -- maintenance ---------------------------------------------------------------------------

SWEEP_INTERVAL_S = 5.0
SWEEP_BUSY_INTERVAL_S = 1.0
SWEEP_BATCH = 1000
SWEEP_BUDGET_S = 0.25
_sweep_position: dict[str, tuple[bytes, int] | None] = {}


def sweep_once(storage: Storage, conn: psycopg.Connection, batch: int = SWEEP_BATCH,
               budget_s: float = SWEEP_BUDGET_S) -> tuple[int, bool]:
    """Delete stale unique keys for up to ``budget_s`` seconds (the leader's step); returns ``(swept, busy)``.

    Walks the key table in key order, a batch (one transaction) at a time,
    resuming where the last call stopped and starting over at the end; a
    key being taken right now is skipped (SKIP LOCKED). ``busy`` is True
    when the walk stopped on the budget rather than at the end of the table
    (call again soon).
    """
    import time

    deadline = time.monotonic() + budget_s
    total = 0
    while True:
        after = _sweep_position.get(storage.schema)
        swept, _scanned, pos = storage.unique_sweep(conn, after, batch)
        _sweep_position[storage.schema] = pos
        total += swept
        if pos is None:
            busy = False
            break
        if time.monotonic() >= deadline:
            busy = True
            break
    if total:
        log.info("swept %d stale unique keys", total, extra={"action": "unique_sweep"})
    return total, busy


__all__ = ["DEFAULT_STATES", "Unique", "UniqueConflict", "UniqueManyResult", "canonical_json", "sweep_once"]
