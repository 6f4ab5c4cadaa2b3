"""What the dashboard shows and does, as plain JSON-able data.

Job, queue and DLQ reads and every action go through the public API of
:class:`awa_fast.App` (the same calls a user's code makes), on connections
from one small pool. The runtime and storage pages read the storage
layer's cheap signals: lane-head depth, ring state, statistics-collector
row counts, the local supervisors' shared-memory segments.
"""

from __future__ import annotations

import collections
import pathlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import psycopg
from psycopg_pool import ConnectionPool

from awa_fast.storage import Storage

SAMPLE_EVERY_S = 5.0
HISTORY_S = 3600.0
# The terminal counts read the live history (done_entries: one row per job for failures, cancels,
# results and quiet completions, kept for history_retention), so their cost grows with traffic
# times retention: 150 ms at 720k rows (performance-log, 2026-12-07 dashboard). They are read at
# most once per window of max(0.8 x sample_every, last read's duration / TERMINAL_SHARE).
TERMINAL_SHARE = 0.05


def jsonable(obj: Any) -> Any:
    """Structs, dataclasses, datetimes and bytes as JSON-able builtins."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            return msgspec.json.decode(bytes(obj))
        except msgspec.DecodeError:
            return bytes(obj).decode("utf-8", "replace")
    return msgspec.to_builtins(obj, enc_hook=_enc_hook)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return jsonable(obj)
    return str(obj)


class Backend:
    """The dashboard's data source over one App and its schema."""

    def __init__(self, app: Any, dsn: str, home: pathlib.Path | None = None, *,
                 sample_every: float = SAMPLE_EVERY_S) -> None:
        self.app = app
        self.sample_every = sample_every
        self.storage = Storage(app.storage.schema)
        self.home = home
        self.pool = ConnectionPool(dsn, min_size=1, max_size=4, open=True,
                                   kwargs={"autocommit": True, "application_name": "awa_fast:dashboard"})
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=int(HISTORY_S / sample_every))
        self._last_totals: dict[str, int] | None = None
        self._last_read_at = 0.0
        self._rates: dict[str, float | None] = {"completed": None, "failed": None}
        self._last_hist: dict[str, list[int]] | None = None
        self._clock = time.monotonic
        self._terminal_lock = threading.Lock()
        self._terminal: tuple[float, dict[str, dict[str, int]]] | None = None
        self._terminal_due = 0.0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Take the first sample and keep sampling (every 5 s by default) for the overview charts."""
        self.sample()
        self._sampler = threading.Thread(target=self._sample_loop, name="awa-dashboard-sampler", daemon=True)
        self._sampler.start()

    def close(self) -> None:
        self._stop.set()
        self.pool.close()

    @contextmanager
    def conn(self) -> Iterator[psycopg.Connection]:
        with self.pool.connection() as c:
            yield c

    # -- sampling --------------------------------------------------------------------

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.sample_every):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a missed sample only leaves a gap in a chart
                continue

    def sample(self) -> dict[str, Any]:
        """One chart point: completions and failures per second since the last point, latency percentiles."""
        from awa_fast.runtime.shm import histogram_percentiles

        read_at, terminal = self.terminal_counts()
        if read_at > self._last_read_at:  # a new read: the rates over the time since the one before
            totals = {k: sum(q.get(k, 0) for q in terminal.values()) for k in ("completed", "failed")}
            if self._last_totals is not None:
                dt = max(read_at - self._last_read_at, 1e-6)
                self._rates = {k: max(0, totals[k] - self._last_totals[k]) / dt for k in totals}
            self._last_totals, self._last_read_at = totals, read_at
        hist = self._local_histograms()
        point: dict[str, Any] = {"t": time.time(), "completed_per_s": self._rates["completed"],
                                 "failed_per_s": self._rates["failed"], "pickup_p50_ms": None,
                                 "pickup_p95_ms": None, "e2e_p50_ms": None, "e2e_p95_ms": None}
        if self._last_hist is not None:
            for which in ("pickup", "e2e"):
                delta = [max(0, a - b)
                         for a, b in zip(hist.get(which, []), self._last_hist.get(which, []), strict=False)]
                if sum(delta):
                    pct = histogram_percentiles(delta, (0.5, 0.95))
                    for q in ("p50", "p95"):
                        v = pct.get(q)
                        point[f"{which}_{q}_ms"] = None if v is None else v * 1000.0
        self._last_hist = hist
        self.series.append(point)
        return point

    def terminal_counts(self) -> tuple[float, dict[str, dict[str, int]]]:
        """(when read, on the backend's clock; completed/failed/cancelled per queue), shared by the
        sampler and every overview poll.

        Read again only once the window since the last read has passed: at least
        ``0.8 * sample_every``, and long enough that reads take at most ``TERMINAL_SHARE``
        of one backend's time, however long the history and however many pages poll. Until
        then the chart carries the last rate forward (a rate over the whole window).
        """
        with self._terminal_lock:
            t0 = self._clock()
            if self._terminal is None or t0 >= self._terminal_due:
                with self.conn() as c:
                    counts = self.storage.queue_terminal_counts(c)
                took = self._clock() - t0
                self._terminal = (t0, counts)
                self._terminal_due = t0 + max(0.8 * self.sample_every, took / TERMINAL_SHARE)
            return self._terminal

    def _local_histograms(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for snap in self.local_snapshots():
            for c in snap.get("claimers", []):
                for which in ("pickup", "e2e"):
                    buckets = (c.get(which) or {}).get("buckets") or []
                    acc = out.setdefault(which, [0] * len(buckets))
                    for i, n in enumerate(buckets):
                        acc[i] += n
        return out

    def local_snapshots(self) -> list[dict[str, Any]]:
        """Shared-memory snapshots of the supervisors on this host (empty without a home)."""
        if self.home is None:
            return []
        from awa_fast.runtime.status import local_snapshots

        return local_snapshots(self.home, self.storage.schema)

    # -- reads -----------------------------------------------------------------------

    def overview(self) -> dict[str, Any]:
        terminal = self.terminal_counts()[1]
        with self.conn() as c:
            depth = self.storage.queue_depth_fast(c)
            dlq = self.storage.dlq_depth(c)
            leader = self.storage.leader_info(c)
        queues = sorted(set(depth) | set(terminal) | set(dlq))
        return {"schema": self.storage.schema, "leader": jsonable(leader),
                "queues": [{"queue": q, "available": depth.get(q, 0), "dlq": dlq.get(q, 0),
                            **terminal.get(q, {})} for q in queues],
                "series": list(self.series)}

    def queues(self) -> list[dict[str, Any]]:
        with self.conn() as c:
            listed = self.storage.queue_list(c)
            counts = self.storage.queue_counts_exact(c)
            depth = self.storage.queue_depth_fast(c)
        out = []
        for q in listed:
            name = q["queue"]
            out.append({**jsonable(q), "available": depth.get(name, 0), "counts": counts.get(name, {})})
        return out

    def jobs(self, *, queue: str | None, kind: str | None, state: str | None, limit: int,
             before_id: int | None) -> list[dict[str, Any]]:
        with self.conn() as c:
            found = self.app.list_jobs(queue=queue, kind=kind, state=state, limit=limit, before_id=before_id,
                                       conn=c)
        return [jsonable(j) for j in found]

    def job(self, job_id: int) -> dict[str, Any] | None:
        with self.conn() as c:
            info = self.app.get_job(job_id, conn=c)
        return None if info is None else jsonable(info)

    def dlq(self, *, queue: str | None, limit: int) -> list[dict[str, Any]]:
        with self.conn() as c:
            return [jsonable(e) for e in self.app.dlq_list(queue=queue, limit=limit, conn=c)]

    def runtime(self) -> dict[str, Any]:
        with self.conn() as c:
            leader = self.storage.leader_info(c)
            sessions = self.storage.runtime_sessions(c)
        return {"leader": jsonable(leader), "sessions": jsonable(sessions),
                "local": [jsonable(_without_buckets(s)) for s in self.local_snapshots()]}

    def rings(self) -> dict[str, Any]:
        with self.conn() as c:
            state = self.storage.ring_state(c)
            slots = self.storage.ring_slot_stats(c)
            dead = self.storage.dead_tuples(c)
        local = self.local_snapshots()
        prune = local[0]["maintenance"]["rings"] if local else {}
        return {"rings": jsonable(state), "slots": jsonable(slots), "dead_tuples": dead,
                "prune": jsonable(prune)}

    def schedules(self) -> list[dict[str, Any]]:
        """Every periodic schedule: name, cron, timezone, next and last fire, paused (what ``cron list`` shows)."""
        from awa_fast.cron_cli import next_fire

        with self.conn() as c:
            now, rows = self.storage.schedule_list(c)
        keys = ("name", "cron", "timezone", "kind", "queue", "missed", "paused", "enabled", "source")
        return [{**{k: r[k] for k in keys}, "next_fire": jsonable(next_fire(r, now)) if now else None,
                 "last_fire": jsonable(r["last_tick"]), "last_fired_at": jsonable(r["last_fired_at"])}
                for r in rows]

    # -- actions (the caller has checked the token) ------------------------------------

    def schedule_pause(self, name: str, paused: bool) -> bool:
        """Pause or resume one schedule; False when there is no such schedule."""
        with self.conn() as c:
            return self.storage.schedule_pause(c, name, paused)

    def schedule_trigger(self, name: str) -> tuple[str, int | None]:
        """Fire one schedule now, outside its ticks: ``(outcome, job_id)``, outcome ``inactive`` if unknown."""
        from awa_fast.periodic import trigger

        with self.conn() as c:
            return trigger(self.storage, c, name)

    def cancel(self, job_id: int) -> bool:
        with self.conn() as c:
            return bool(self.app.cancel(job_id, conn=c))

    def retry(self, job_id: int) -> bool:
        with self.conn() as c:
            return bool(self.app.retry(job_id, conn=c))

    def dlq_retry(self, job_ids: list[int] | None, queue: str | None) -> int:
        with self.conn() as c:
            return _count(self.app.dlq_retry(job_ids=job_ids, queue=queue, conn=c))

    def dlq_purge(self, job_ids: list[int] | None, queue: str | None) -> int:
        with self.conn() as c:
            return _count(self.app.dlq_purge(job_ids=job_ids, queue=queue, conn=c))

    def pause(self, queue: str, paused: bool) -> bool:
        with self.conn() as c:
            result = self.app.pause(queue, conn=c) if paused else self.app.resume(queue, conn=c)
        return result is not False


def _count(result: Any) -> int:
    """How many entries an action touched (the API returns the ids, or a count)."""
    return len(result) if isinstance(result, (list, tuple, set)) else int(result)


def _without_buckets(snap: dict[str, Any]) -> dict[str, Any]:
    out = dict(snap)
    out.pop("histogram_bounds", None)
    out["claimers"] = [{k: ({kk: vv for kk, vv in v.items() if kk != "buckets"} if isinstance(v, dict) else v)
                        for k, v in c.items()} for c in snap.get("claimers", []) if c.get("pid")]
    return out
