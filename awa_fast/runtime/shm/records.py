"""The records of the segment: status records (one per claimer) and the ring section's values.

Every record starts with a **seqlock** version counter: a writer makes it
odd, writes, then makes it even again; a reader copies the record between two
reads of the counter and retries while they differ or are odd, up to
``READ_ATTEMPTS`` times, then returns the last copy with ``torn=True``. A
writer that died mid-write leaves the counter odd; every read of that record
is then ``torn`` until the next write. (Ordering: CPython gives no memory
barriers; x86-64 stores and loads are not reordered with each other, so the
check is exact there. On weakly ordered CPUs a torn read may rarely go
undetected - acceptable for a dashboard.)

A status record has exactly one writer process at a time (its claimer; the
supervisor only after that claimer has exited); inside a process a
per-record lock serializes threads. The claimer tallies locally (plain
integers and sample lists, under its own lock) and publishes once per flush
or idle claim loop: :meth:`StatusRecord.publish` is one seqlock write of
every counter, gauge and histogram.
"""

from __future__ import annotations

import hashlib
import operator
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from struct import Struct
from typing import TYPE_CHECKING, Any

from awa_fast.runtime.shm.histogram import (
    SIZE_EDGES,
    TIME_EDGES,
    histogram_percentiles,
    size_counts,
    time_counts,
)
from awa_fast.runtime.shm.layout import (
    ALIVE_SCALARS,
    CLAIMER_STATES,
    CLAIMERS_OFFSET,
    COUNTERS,
    F64,
    GAUGES,
    HIST_OFFSETS,
    HIST_SLICES,
    HISTOGRAMS,
    PRUNE_OUTCOMES,
    R_ALIVE,
    R_GAUGES,
    R_STATE,
    R_USED,
    READ_ATTEMPTS,
    REC_ALL,
    REC_LIFE,
    RECORD_SIZE,
    RING_FIELDS,
    S_COUNTS,
    S_GAUGES,
    SEQ,
    SIZE_HIST,
    SIZE_HISTOGRAMS,
    TIME_HIST,
    TIME_HISTOGRAMS,
    U64,
    ShmError,
)

if TYPE_CHECKING:
    from awa_fast.runtime.shm.segment import ShmSegment

__all__ = ["RingSnapshot", "RingState", "StatusRecord", "prune_outcome_counts", "prune_outcome_fields"]

_COUNTER_POS = {k: S_COUNTS + i for i, k in enumerate(COUNTERS)}
_GAUGE_POS = {k: S_GAUGES + i for i, k in enumerate(GAUGES)}
_ADD_ALIASES = {"batches": "batches_flushed"}


# -- small helpers -------------------------------------------------------------
def fixed_text(text: str, size: int) -> bytes:
    """``text`` as utf-8 of at most ``size`` bytes (longer: a head, "~" and 8 hex digits of its hash)."""
    raw = text.encode("utf-8")
    if len(raw) <= size:
        return raw
    tag = "~" + hashlib.blake2b(raw, digest_size=4).hexdigest()
    head = raw[: size - len(tag)].decode("utf-8", "ignore")
    return (head + tag).encode("utf-8")


def text_of(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def host_hash(host: str) -> int:
    return int.from_bytes(hashlib.blake2b(host.encode("utf-8"), digest_size=8).digest(), "little")


def odd_version(buf: memoryview, off: int) -> int:
    """The odd version that opens the next write (also past a writer that died mid-write)."""
    seq: int = SEQ.unpack_from(buf, off)[0]
    return seq + 2 if seq & 1 else seq + 1


def read_consistent(buf: memoryview, off: int, size: int) -> tuple[bytes, bool]:
    """Copy ``size`` bytes at ``off`` (seqlock version first); return (bytes, torn)."""
    data = b""
    for attempt in range(READ_ATTEMPTS):
        before = SEQ.unpack_from(buf, off)[0]
        data = bytes(buf[off : off + size])
        if not before & 1 and SEQ.unpack_from(buf, off)[0] == before:
            return data, False
        if attempt >= 3:
            os.sched_yield()
    return data, True


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def prune_outcome_fields(counts: Mapping[str, int], prefix: str = "prune_") -> dict[str, int]:
    """Fold ``ring_prune`` outcome words -> counts into the ring fields ``<prefix><outcome>``.

    'pruned', 'empty', 'busy', 'current' and 'retained' count as themselves;
    any gate name ('pending_ready', 'open_claims', 'cursor_behind',
    'active_leases') counts as 'blocked'. ``prefix`` is ``prune_`` for the
    last pass, ``total_`` for running totals.
    """
    out = dict.fromkeys((f"{prefix}{o}" for o in PRUNE_OUTCOMES), 0)
    for word, n in counts.items():
        key = word if word in PRUNE_OUTCOMES else "blocked"
        out[f"{prefix}{key}"] += int(n)
    return out


def prune_outcome_counts(outcomes: Sequence[str]) -> dict[str, int]:
    """:func:`prune_outcome_fields` of a list of words (one per slot), as ``prune_*`` fields."""
    counts: dict[str, int] = {}
    for word in outcomes:
        counts[word] = counts.get(word, 0) + 1
    return prune_outcome_fields(counts)


# -- the ring section's values ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class RingState:
    """One ring as last published by the maintenance process (``prune_*``: last pass, ``total_*``: totals)."""

    current_slot: int
    generation: int
    slot_count: int
    last_rotate: float
    last_prune: float
    prune_pruned: int
    prune_empty: int
    prune_busy: int
    prune_blocked: int
    prune_current: int
    prune_retained: int
    total_pruned: int
    total_empty: int
    total_busy: int
    total_blocked: int
    total_current: int
    total_retained: int


@dataclass(frozen=True, slots=True)
class RingSnapshot:
    """The ring section: leader identity, maintenance totals and the three rings; ``torn`` if unverified."""

    leader_pid: int
    leader_host: str
    leader_host_hash: int
    leader_since: float
    last_tick: float
    role: str
    totals: dict[str, int]
    rings: dict[str, RingState]
    torn: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


assert tuple(RingState.__slots__) == RING_FIELDS  # the section's field order


# -- a claimer's status record ---------------------------------------------------------
class StatusRecord:
    """One claimer's status record: counters, gauges, histograms, heartbeat. One writer process at a time."""

    __slots__ = ("_segment", "_off", "_lock", "index")

    def __init__(self, segment: ShmSegment, index: int) -> None:
        self._segment = segment
        self.index = index
        self._off = CLAIMERS_OFFSET + index * RECORD_SIZE
        self._lock = threading.Lock()

    def _buf(self) -> memoryview:
        buf = self._segment._buf
        if buf is None:
            raise ShmError(f"shared-memory segment {self._segment.name!r} is closed")
        return buf

    def set_state(self, state: str, pid: int | None = None) -> None:
        """Set the state; 'starting' also records the pid (default: this process) and counts a start."""
        code = CLAIMER_STATES.index(state) if state in CLAIMER_STATES else -1
        if code < 0:
            raise ValueError(f"unknown claimer state {state!r}; use one of {CLAIMER_STATES}")
        buf = self._buf()
        off = self._off
        now = time.time()
        with self._lock:
            _, old_pid, starts, _, _ = REC_LIFE.unpack_from(buf, off + R_STATE)
            if state == "starting":
                old_pid = os.getpid() if pid is None else pid
                starts += 1
            elif pid is not None:
                old_pid = pid
            seq = odd_version(buf, off)
            SEQ.pack_into(buf, off, seq)
            REC_LIFE.pack_into(buf, off + R_STATE, code, old_pid, starts, now, now)
            SEQ.pack_into(buf, off, seq + 1)

    def _write_u64(self, at: int, value: int) -> None:
        buf = self._buf()
        off = self._off
        now = time.time()
        with self._lock:
            seq = odd_version(buf, off)
            SEQ.pack_into(buf, off, seq)
            U64.pack_into(buf, off + at, max(value, 0))
            F64.pack_into(buf, off + R_ALIVE, now)
            SEQ.pack_into(buf, off, seq + 1)

    def heartbeat(self) -> None:
        """Refresh last-alive (every other write refreshes it too)."""
        buf = self._buf()
        off = self._off
        now = time.time()
        with self._lock:
            seq = odd_version(buf, off)
            SEQ.pack_into(buf, off, seq)
            F64.pack_into(buf, off + R_ALIVE, now)
            SEQ.pack_into(buf, off, seq + 1)

    def publish(
        self,
        counts: Mapping[str, int] | None = None,
        samples: Mapping[str, Sequence[float]] | None = None,
        **gauges: int,
    ) -> None:
        """Add counters and histogram samples, set gauges and refresh last-alive: one seqlock write.

        ``counts`` maps :data:`COUNTERS` names (``batches`` is an alias of
        ``batches_flushed``; zero values cost nothing) to increments;
        ``samples`` maps :data:`HISTOGRAMS` names to raw samples (seconds for
        the time histograms, job counts for the size ones), bucketed here;
        keyword gauges (:data:`GAUGES`) are set as given.
        """
        adds: list[tuple[int, int]] = []
        for key, n in (counts or {}).items():
            if n:
                pos = _COUNTER_POS.get(_ADD_ALIASES.get(key, key))
                if pos is None:
                    raise ValueError(f"unknown counter {key!r}; use one of {COUNTERS}")
                adds.append((pos, n))
        hists: list[tuple[int, Struct, list[int], float]] = []
        for key, values in (samples or {}).items():
            hoff = HIST_OFFSETS.get(key)
            if hoff is None:
                raise ValueError(f"unknown histogram {key!r}; use one of {HISTOGRAMS}")
            if values:
                if key in TIME_HISTOGRAMS:
                    hists.append((hoff, TIME_HIST, *time_counts(values)))
                else:
                    hists.append((hoff, SIZE_HIST, *size_counts(values)))  # type: ignore[arg-type]
        sets: list[tuple[int, int]] = []
        for key, value in gauges.items():
            pos = _GAUGE_POS.get(key)
            if pos is None:
                raise ValueError(f"unknown gauge {key!r}; use one of {GAUGES}")
            sets.append((pos, max(int(value), 0)))
        buf = self._buf()
        off = self._off
        with self._lock:
            # single writer: its own fields need no seqlock to read; every part below is one write
            seq = odd_version(buf, off)
            SEQ.pack_into(buf, off, seq)
            v = list(ALIVE_SCALARS.unpack_from(buf, off + R_ALIVE))
            v[0] = time.time()
            for pos, n in adds:
                v[pos] += n
            for pos, g in sets:
                v[pos] = g
            ALIVE_SCALARS.pack_into(buf, off + R_ALIVE, *v)
            for hoff, struct_, inc, total in hists:
                old = struct_.unpack_from(buf, off + hoff)
                struct_.pack_into(buf, off + hoff, *map(operator.add, old, inc), old[-1] + total)
            SEQ.pack_into(buf, off, seq + 1)

    def add(self, **counts: int) -> None:
        """Add to the counters (``batches`` goes to batches_flushed) in one seqlock write."""
        self.publish(counts)

    def observe(self, which: str, samples: Sequence[float]) -> None:
        """Add samples to one histogram (see :data:`HISTOGRAMS`) in one seqlock write."""
        if which not in HIST_SLICES:
            raise ValueError(f"unknown histogram {which!r}; use one of {HISTOGRAMS}")
        if samples:
            self.publish(samples={which: samples})

    def observe_latency(self, which: str, seconds_list: Sequence[float]) -> None:
        """Add samples (seconds) to a time histogram ('pickup', 'e2e', ...) in one seqlock write."""
        if which not in TIME_HISTOGRAMS:
            raise ValueError(f"unknown histogram {which!r}; use one of {TIME_HISTOGRAMS}")
        self.observe(which, seconds_list)

    def set_in_flight(self, n: int) -> None:
        """Set the in-flight gauge (jobs claimed and not yet handed to the batcher)."""
        self._write_u64(R_GAUGES + 8 * GAUGES.index("in_flight"), n)

    def set_abandoned(self, n: int) -> None:
        """Set the abandoned gauge: sync handlers still running although their attempt was rescued."""
        self._write_u64(R_GAUGES + 8 * GAUGES.index("abandoned"), n)

    def read(self) -> dict[str, Any]:
        """The record as a plain dict (counters, gauges, histograms with percentiles, ``torn``)."""
        data, torn = read_consistent(self._buf(), self._off, R_USED)
        v = REC_ALL.unpack_from(data)
        state = v[3]
        out: dict[str, Any] = {
            "index": self.index,
            "queue": text_of(v[1]),
            "stripe": v[2],
            "state": CLAIMER_STATES[state] if state < len(CLAIMER_STATES) else f"unknown({state})",
            "pid": v[4],
            "starts": v[5],
            "last_alive": v[6],
            "state_since": v[7],
        }
        shift = 6  # REC_ALL index of STATS index 0 (last alive): seq, queue, stripe, state, pid, starts come first
        for key, pos in (*_COUNTER_POS.items(), *_GAUGE_POS.items()):
            out[key] = v[shift + pos]
        for which in HISTOGRAMS:
            pos, nb = HIST_SLICES[which]
            counts = list(v[shift + pos : shift + pos + nb])
            total = sum(counts)
            value_sum = v[shift + pos + nb]
            edges = SIZE_EDGES if which in SIZE_HISTOGRAMS else TIME_EDGES
            out[which] = {
                "count": total,
                "sum": value_sum,
                "mean": value_sum / total if total else None,
                **histogram_percentiles(counts, edges=edges),
                "buckets": counts,
            }
        out["torn"] = torn
        return out
