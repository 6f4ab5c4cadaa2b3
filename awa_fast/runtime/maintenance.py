"""Leader-elected maintenance: promote, rescue, rotate and prune the rings, DLQ retention.

Exactly one maintenance process leads across every supervisor on every
host sharing the database: leadership is a session advisory lock held on
the leader's own connection, and every maintenance statement runs on that
same connection, so a leader that loses its connection loses its lock and
can do nothing more (fencing). Standbys try to take the lock every
``election_interval`` seconds.

Each service is a method with a ``run_once`` shape that tests call directly.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from awa_fast import periodic as _periodic
from awa_fast import proctitle
from awa_fast.errors import DatabaseUnavailable
from awa_fast.runtime.shm.layout import RINGS  # the one ring order (also the shared-memory section's)
from awa_fast.runtime.stopflag import StopFlag
from awa_fast.storage import Storage, close_quietly, connect

log = logging.getLogger("awa_fast.maintenance")


@dataclass(frozen=True, slots=True)
class MaintenanceConfig:
    """Intervals (seconds) and limits of the maintenance services."""

    dsn: str = field(repr=False)  # a DSN may carry a password
    schema: str
    election_interval: float = 1.0
    promote_interval: float = 0.25
    rescue_interval: float = 1.0
    # "ready" absent: the ready ring follows the queues' history_retention (see ready_timing).
    # The claim ring every 4 s: each of its prunes (a TRUNCATE) holds every claim for ~3 ms and
    # makes every claimer plan its claim again, so fewer, larger prunes cut the pickup tail
    # (docs/storage.md, "Rotation and prune").
    rotate_intervals: dict[str, float] = field(default_factory=lambda: {"claim": 4.0, "lease": 30.0})
    prune_interval: float = 0.5
    # every slot is asked again at least this often, even one known clean (see Maintenance.prune_once)
    prune_recheck_interval: float = 15.0
    dlq_retention_interval: float = 60.0
    prune_lock_timeout_ms: int = 50
    batch: int = 2000


class Maintenance:
    """The maintenance process: leader election plus the services it runs."""

    def __init__(self, config: MaintenanceConfig, publish: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.storage = Storage(config.schema)
        self._publish = publish
        self._conn: psycopg.Connection | None = None
        self._leader = False
        self._stop = StopFlag()  # set by stop(), which a signal handler calls (see StopFlag)
        self._last: dict[str, float] = {}
        self.leader_since: float | None = None
        self.parent_pid: int | None = None  # stop when this process (the supervisor) is gone
        self.last_prune: dict[str, dict[str, int]] = {}
        self.prune_totals: dict[str, dict[str, int]] = {}  # ring -> outcome word -> slots, since start
        self.last_prune_at: dict[str, float] = {}
        self.last_rotate_at: dict[str, float] = {}
        self._ready_timing: tuple[float, float, float] | None = None  # (read at, retention s, rotate s)
        # The prune's knowledge of each ring, this leadership's only (see prune_once): the slots
        # it need not ask before a time (slot -> (the answer it repeats, monotonic time to ask
        # again)), the (slot, generation) seen at the last pass, and when every slot was last asked.
        self._known: dict[str, dict[int, tuple[str, float]]] = {}
        self._seen: dict[str, tuple[int, int]] = {}
        self._rechecked_at: dict[str, float] = {}
        self.counters = {"promoted": 0, "rescued": 0, "callback_rescued": 0, "rotated": 0, "pruned": 0,
                         "prune_skipped": 0, "dlq_pruned": 0, "elections_won": 0}

    # -- leadership --------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self._leader

    def try_lead(self) -> bool:
        """Try to become leader (non-blocking); True if this process leads now."""
        if self._leader:
            return True
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.config.dsn, application_name=f"awa_fast:maintenance:{self.config.schema}")
                self.storage.session_read_committed(self._conn)  # prune's cursor advance (migration 0028)
            won = self.storage.leader_lock_try(self._conn)
        except (psycopg.Error, DatabaseUnavailable) as exc:
            log.warning("leader election failed: %s", exc, extra={"action": "election_error"})
            self._drop_connection()
            return False
        if won:
            self._leader = True
            self.leader_since = time.time()
            # A new leader rotates only after a full interval of its own.
            now = time.monotonic()
            for ring in RINGS:
                self._last[f"rotate:{ring}"] = now
            self.counters["elections_won"] += 1
            self._forget_clean()
            log.info("maintenance leader elected (pid %d on %s)", os.getpid(), socket.gethostname(),
                     extra={"action": "leader_elected"})
            proctitle.mark_leader(True)
        return self._leader

    def resign(self) -> None:
        """Give up leadership and close the connection (the lock goes with it)."""
        self._drop_connection()

    def _forget_clean(self) -> None:
        """Treat every slot of every ring as possibly written (a new leadership knows nothing)."""
        self._known.clear()
        self._seen.clear()
        self._rechecked_at.clear()

    def _drop_connection(self) -> None:
        if self._leader:
            log.info("maintenance leadership lost or resigned", extra={"action": "leader_lost"})
            proctitle.mark_leader(False)
        self._leader = False
        self.leader_since = None
        close_quietly(self._conn)
        self._conn = None

    # -- services (each runs only while leading) ---------------------------------------

    def promote_once(self) -> int:
        """Promote due deferred jobs (scheduled, retryable, snoozed) into ready."""
        n = self.storage.deferred_promote(self._lead_conn(), self.config.batch)
        self.counters["promoted"] += n
        return n

    def rescue_once(self) -> int:
        """Rescue stale receipts and timed-out callbacks; sweep orphan attempt_state rows."""
        conn = self._lead_conn()
        n = self.storage.receipt_rescue_stale(conn, self.config.batch)
        m = self.storage.lease_rescue_expired(conn, self.config.batch)
        self.storage.attempt_state_sweep(conn)
        self.counters["rescued"] += n
        self.counters["callback_rescued"] += m
        if n or m:
            log.info("rescued %d stale attempts and %d timed-out callbacks", n, m, extra={"action": "rescue"})
        return n + m

    def rotate_once(self, ring: str) -> int | None:
        """Rotate one ring if its current slot holds rows and its next slot is free.

        Returns the new slot, or None. An empty current slot is not sealed:
        rotating it would only grow the ledger.
        """
        conn = self._lead_conn()
        state = self.storage.ring_state(conn)[ring]
        current, count = int(state["slot"]), int(state["slots"])
        if self.storage.ring_slot_empty(conn, ring, current):
            return None
        slot = self.storage.ring_rotate(conn, ring)
        if slot is None:
            # the next slot holds rows (a write that came after its last prune, into a slot
            # that was no longer current): the prune must look at it again
            self._known.get(ring, {}).pop((current + 1) % count, None)
        else:
            self.counters["rotated"] += 1
            self.last_rotate_at[ring] = time.time()
        return slot

    def prune_once(self, ring: str) -> dict[str, int]:
        """Prune every sealed slot of a ring, oldest first; outcome word -> count.

        The ready ring keeps a quiet slot for the history retention first
        (``retained``), unless an explicit ready rotation interval is set.

        A slot found ``empty`` or ``pruned`` is clean: it is not asked again
        (and counts as ``empty``) until it has been current once more, or a
        rotation found it holding rows, or ``prune_recheck_interval`` has
        passed since every slot was last asked (a late write into a sealed
        slot: a claim or a producer that read the current slot just before a
        rotation). A ``retained`` slot is asked again after a tenth of the
        retention (at most the recheck interval), so its prune comes at most
        that late. Skipping a slot never removes a row, it only defers a
        prune, and a ring is never stuck: the rotation that needs the slot
        makes the next pass ask it. So an idle ring costs one ``ring_state``
        read per pass, not one call per slot.
        """
        conn = self._lead_conn()
        state = self.storage.ring_state(conn)[ring]
        current, count, generation = int(state["slot"]), int(state["slots"]), int(state["generation"])
        now = time.monotonic()
        known = self._known_since_last_pass(ring, current, count, generation, now)
        retain = self.ready_timing(count)[0] if ring == "ready" else None
        outcomes: dict[str, int] = {}
        for i in range(1, count):
            slot = (current + i) % count
            if slot in known and now < known[slot][1]:
                word = known[slot][0]
            else:
                if retain is None:
                    word = self.storage.ring_prune(conn, ring, slot, self.config.prune_lock_timeout_ms)
                else:
                    word = self.storage.ring_prune_retained(conn, ring, slot, retain,
                                                            self.config.prune_lock_timeout_ms)
                if word in ("empty", "pruned"):
                    known[slot] = ("empty", math.inf)
                elif word == "retained" and retain is not None:
                    known[slot] = (word, now + min(retain / 10, self.config.prune_recheck_interval))
                else:
                    known.pop(slot, None)
                if word == "pruned":
                    self.counters["pruned"] += 1
                elif word not in ("empty", "current", "retained"):
                    self.counters["prune_skipped"] += 1
            outcomes[word] = outcomes.get(word, 0) + 1
        self.last_prune[ring] = outcomes
        totals = self.prune_totals.setdefault(ring, {})
        for word, n in outcomes.items():
            totals[word] = totals.get(word, 0) + n
        self.last_prune_at[ring] = time.time()
        return outcomes

    def _known_since_last_pass(self, ring: str, current: int, count: int, generation: int,
                               now: float) -> dict[int, tuple[str, float]]:
        """What the prune knows of the ring's slots, less every slot that may have been written since the last pass.

        Each rotation moves the ring one slot on, so the slots current since the
        last pass are the ``generation`` difference's worth from the slot seen
        then (all of them after a full cycle, or a generation that went back).
        """
        known = self._known.setdefault(ring, {})
        seen = self._seen.get(ring)
        if seen is None or now - self._rechecked_at.get(ring, -math.inf) >= self.config.prune_recheck_interval:
            known.clear()
            self._rechecked_at[ring] = now
        else:
            slot, gen = seen
            moved = generation - gen
            if moved < 0 or moved >= count:
                known.clear()
            else:
                for k in range(moved + 1):
                    known.pop((slot + k) % count, None)
        known.pop(current, None)
        self._seen[ring] = (current, generation)
        return known

    def ready_timing(self, slots: int | None = None) -> tuple[float | None, float]:
        """(history retention s, rotation interval s) of the ready ring.

        With no explicit ``rotate_intervals["ready"]`` both follow the
        database: the retention is the longest ``history_retention`` of any
        queue (the ring is shared, so each queue's is a minimum), and the
        ring rotates every retention / (slots - 1) (at least 1 s), so that
        the sealed slots span the retention and prune stays TRUNCATE. An
        explicit interval (tests, benchmarks) rotates at that pace and
        prunes a sealed slot as soon as its gates pass: no retention (None).
        Read from the database at most once per prune interval.
        """
        fixed = self.config.rotate_intervals.get("ready")
        if fixed is not None:
            return None, fixed
        now = time.monotonic()
        cached = self._ready_timing
        if cached is None or now - cached[0] >= self.config.prune_interval:
            conn = self._lead_conn()
            if slots is None:
                slots = int(self.storage.ring_state(conn)["ready"]["slots"])
            retain = self.storage.ready_retention(conn)
            cached = self._ready_timing = (now, retain, max(1.0, retain / max(slots - 1, 1)))
        return cached[1], cached[2]

    def dlq_retention_once(self) -> int:
        n = self.storage.dlq_retention_prune(self._lead_conn(), self.config.batch)
        self.counters["dlq_pruned"] += n
        return n

    def _lead_conn(self) -> psycopg.Connection:
        if not self._leader or self._conn is None:
            raise RuntimeError("not the maintenance leader")
        return self._conn

    # -- loop --------------------------------------------------------------------------

    def run_once(self) -> None:
        """Run every service that is due (as leader)."""
        cfg = self.config
        now = time.monotonic()

        def due(name: str, interval: float) -> bool:
            if now - self._last.get(name, -1e9) >= interval:
                self._last[name] = now
                return True
            return False

        if due("promote", cfg.promote_interval):
            self.promote_once()
        if due("rescue", cfg.rescue_interval):
            self.rescue_once()
        for ring in RINGS:
            interval = self.ready_timing()[1] if ring == "ready" else cfg.rotate_intervals.get(ring, 30.0)
            if due(f"rotate:{ring}", interval) and self.rotate_once(ring) is None and ring == "ready" \
                    and self.ready_timing()[0] is not None:
                # not rotated (next slot still retained, or nothing to seal): try again after one prune
                # interval rather than a whole rotation interval, so the ring keeps its pace
                self._last[f"rotate:{ring}"] = now - interval + cfg.prune_interval
        if due("prune", cfg.prune_interval):
            for ring in RINGS:
                self.prune_once(ring)
        if due("dlq", cfg.dlq_retention_interval):
            self.dlq_retention_once()
        _periodic.leader_step(self.storage, self._lead_conn())  # periodic fires, fire-ledger prune, unique-key sweep
        if self._publish is not None:
            self._publish(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """Leader state and ring positions (for shared memory and status)."""
        rings = {}
        if self._leader and self._conn is not None:
            rings = {k: {"slot": int(v["slot"]), "generation": int(v["generation"]), "slots": int(v["slots"])}
                     for k, v in self.storage.ring_state(self._conn).items()}
        return {"leader": self._leader, "pid": os.getpid(), "leader_since": self.leader_since,
                "rings": rings, "counters": dict(self.counters), "last_prune": dict(self.last_prune),
                "prune_totals": {k: dict(v) for k, v in self.prune_totals.items()},
                "last_prune_at": dict(self.last_prune_at), "last_rotate_at": dict(self.last_rotate_at)}

    def stop(self) -> None:
        """Stop after the current step; safe from a signal handler at any point (StopFlag takes no lock)."""
        self._stop.set()

    def run(self) -> None:
        """Elect, then run services until :meth:`stop`; re-elect after a lost connection."""
        tick = min(self.config.promote_interval, self.config.prune_interval, self.config.election_interval)
        while not self._stop.is_set():
            if not self._leader and not self.try_lead():
                if self._publish is not None:
                    self._publish(self.snapshot())
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    break
                self._stop.wait(self.config.election_interval)
                continue
            try:
                self.run_once()
            except (psycopg.OperationalError, DatabaseUnavailable) as exc:
                log.warning("maintenance connection lost (%s); leadership dropped", exc,
                            extra={"action": "maintenance_error"})
                self._drop_connection()
                continue
            except psycopg.Error as exc:
                log.error("maintenance step failed: %s", exc, extra={"action": "maintenance_error"})
                try:
                    if self._conn is not None and not self._conn.closed:
                        self._conn.rollback()
                except psycopg.Error:
                    self._drop_connection()
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.error("supervisor %d is gone; maintenance stops", self.parent_pid, extra={"action": "orphaned"})
                break
            self._stop.wait(tick)
        self._drop_connection()


def maintenance_main(config: MaintenanceConfig, shm_name: str | None) -> None:
    """Entry point of the maintenance process (forked by the supervisor)."""
    import signal

    from awa_fast.runtime.entry import die_with_parent

    die_with_parent()
    parent = os.getppid()
    ring = None
    publish = None
    if shm_name:
        from awa_fast.runtime.shm import ShmRing

        ring = ShmRing.attach(shm_name)

        def publish(state: dict[str, Any]) -> None:
            from awa_fast.runtime.shm import prune_outcome_fields

            rings: dict[str, dict[str, int | float]] = {}
            for name, st in state["rings"].items():
                fields: dict[str, int | float] = {"current_slot": st["slot"], "generation": st["generation"],
                                                  "slot_count": st["slots"]}
                fields.update(prune_outcome_fields(state["last_prune"].get(name, {})))
                fields.update(prune_outcome_fields(state["prune_totals"].get(name, {}), "total_"))
                if name in state["last_prune_at"]:
                    fields["last_prune"] = state["last_prune_at"][name]
                if name in state["last_rotate_at"]:
                    fields["last_rotate"] = state["last_rotate_at"][name]
                rings[name] = fields
            ring.publish_rings(rings, os.getpid() if state["leader"] else 0,
                               leader_since=state["leader_since"],
                               role="leader" if state["leader"] else "standby",
                               totals={"promoted": state["counters"]["promoted"],
                                       "rescued_receipt": state["counters"]["rescued"],
                                       "rescued_lease": state["counters"]["callback_rescued"]})

    m = Maintenance(config, publish)
    m.parent_pid = parent
    signal.signal(signal.SIGTERM, lambda *_: m.stop())
    signal.signal(signal.SIGINT, lambda *_: m.stop())
    m.run()
    if ring is not None:
        ring.close()
    os._exit(0)
