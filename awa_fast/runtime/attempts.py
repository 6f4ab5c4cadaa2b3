"""The attempts one claimer holds: the one owner of ``held``, ``claimed_at`` and ``stateful``.

An attempt enters when the claim loop dispatches it and leaves when the
completion batcher reports its outcome durable (or, for an attempt parked
for a callback, when its handler returns). Three threads read and write
these structures (claim loop, handler threads through the batcher's
report, heartbeat); every access goes through one lock held for one short
batch operation, never per job and never across I/O.

- ``held``: key -> :class:`~awa_fast.jobs.Job`, every attempt claimed here
  and not yet durably closed.
- ``claimed_at``: key -> monotonic claim time, the attempts the heartbeat
  still has to cover (a stale answer or a park takes an attempt out).
- ``stateful``: keys whose attempt may have an ``attempt_state`` row (a
  heartbeat reached the database for it): their completion deletes that row.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

from awa_fast.jobs import Job

Key = tuple[int, int]  # (job_id, run_lease): one attempt


class AttemptTable:
    """Held attempts of one claimer, behind one lock (see the module docstring)."""

    __slots__ = ("_lock", "_held", "_claimed_at", "_stateful")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Key, Job[Any]] = {}
        self._claimed_at: dict[Key, float] = {}
        self._stateful: set[Key] = set()

    def __len__(self) -> int:
        return len(self._held)

    # -- the claim loop ---------------------------------------------------------------

    def claimed(self, jobs: Sequence[Job[Any]], now: float) -> None:
        """Attempts just claimed (at monotonic ``now``): held and due for heartbeats."""
        keys = [job.key for job in jobs]
        with self._lock:
            self._held.update(zip(keys, jobs, strict=True))  # C loops: one claim is up to thousands of attempts
            self._claimed_at.update(zip(keys, repeat(now)))  # no temporary dict: ~25 ns a job less

    # -- handler threads and the batcher ----------------------------------------------

    def parked(self, jobs: Iterable[Job[Any]]) -> None:
        """Attempts parked for a callback: the lease plane holds them now, not this claimer."""
        with self._lock:
            for job in jobs:
                key = job.key
                self._held.pop(key, None)
                self._claimed_at.pop(key, None)

    def closed(self, keys: Sequence[Key]) -> None:
        """Attempts whose outcome a flush made durable (or dropped): they leave every structure."""
        with self._lock:
            drop_held, drop_claimed = self._held.pop, self._claimed_at.pop
            for key in keys:
                drop_held(key, None)
                drop_claimed(key, None)
            if self._stateful:  # usually empty: no heartbeat reached the database for these
                self._stateful.difference_update(keys)

    def stateful_among(self, keys: Iterable[Key]) -> set[Key]:
        """Of ``keys``, those that may have an ``attempt_state`` row (read by the batcher per flush)."""
        if not self._stateful:  # the common case: no heartbeat reached the database yet
            return set()
        with self._lock:
            return {k for k in keys if k in self._stateful}

    # -- the heartbeat thread ---------------------------------------------------------

    def due(self, now: float, interval: float) -> dict[Key, Job[Any]]:
        """Attempts held at least ``interval`` seconds (receipt-backed ones: parked ones have a lease)."""
        with self._lock:
            held = self._held
            out: dict[Key, Job[Any]] = {}
            for key, started in self._claimed_at.items():
                if now - started >= interval:
                    job = held.get(key)
                    if job is not None and not job.lease_backed:
                        out[key] = job
            return out

    def not_started(self) -> int:
        """Attempts held whose handler has not started: buffered here, every worker slot busy (a gauge)."""
        with self._lock:
            return sum(1 for job in self._held.values() if not job.started_at)

    def held_among(self, keys: Iterable[Key]) -> set[Key]:
        """Of ``keys``, those still held here."""
        with self._lock:
            return {k for k in keys if k in self._held}

    def is_held(self, key: Key) -> bool:
        with self._lock:
            return key in self._held

    def answered(self, stale: Iterable[Key], live: Iterable[Key]) -> None:
        """A heartbeat's answers: stale attempts need no more heartbeats; live ones now have state rows."""
        with self._lock:
            for key in stale:
                self._claimed_at.pop(key, None)
            self._stateful.update(live)
