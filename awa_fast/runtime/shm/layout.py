"""The segment's byte layout (version 2), its names, and the errors of a segment that does not fit it.

Layout version 2, little-endian, every field at its natural alignment;
times are wall-clock seconds from ``time.time()`` as float64, never
monotonic, so other processes and ``awa-fast status`` can compare them::

    header, offset 0, 64 bytes (written once by create, magic last)
      0  8s   magic b"AWAFSHM1"
      8  u32  layout version (2)
     12  u32  status record count N
     16  u32  header size (64)       = offset of the ring section
     20  u32  ring section size (512)
     24  u32  status record size (2176)
     28  u32  time histogram bucket count (40)
     32  u64  segment size = 576 + N * 2176
     40  f64  created at
     48  i64  supervisor pid
     56  u32  size histogram bucket count (16)
     60  4    reserved (0)

    ring section, offset 64, 512 bytes (writer: the local maintenance process)
     +0  u64  seqlock version
     +8  i64  leader pid (0 = unknown)
    +16  u64  leader host hash (first 8 bytes of blake2b(host), little-endian)
    +24  f64  leader since
    +32  f64  last maintenance tick
    +40  u32  role of the local maintenance process (0 unknown, 1 leader, 2 standby)
    +44  u32  reserved
    +48  32s  leader host name, utf-8, NUL padded (truncated to 32 bytes)
    +80  3 x u64 totals: promoted, rescued_receipt, rescued_lease
   +104  136  ring 'claim'  } each ring, in RINGS order, 136 bytes:
   +240  136  ring 'ready'  }  +0 i64 current slot (-1 = not published yet),
   +376  136  ring 'lease'  }  +8 u64 generation, +16 u64 slot count,
                               +24 f64 last rotate, +32 f64 last prune,
                               +40 6 x u64 outcomes of the last prune pass,
                               +88 6 x u64 outcome totals; outcomes in
                               PRUNE_OUTCOMES order (pruned, empty, busy,
                               blocked, current, retained)

    status record i (one per claimer), offset 576 + i * 2176, 2176 bytes (a
    multiple of 64, so two claimers never write the same cache line)
      +0  u64  seqlock version
      +8  64s  queue name, utf-8, NUL padded (longer names: first 55 bytes,
               "~", 8 hex digits of blake2b of the full name)
     +72  u32  stripe index
     +76  u32  state (0 starting, 1 running, 2 draining, 3 stopped)
     +80  i64  pid (0 = never started)
     +88  u64  starts (times the state was set to 'starting')
     +96  f64  last alive (refreshed by every write)
    +104  f64  state since
    +112  11 x u64 counters, COUNTERS order
    +200  3 x u64 gauges, GAUGES order
    +224  5 time histograms, TIME_HISTOGRAMS order: 40 x u64 bucket counts, f64 sum (s)
   +1864  2 size histograms, SIZE_HISTOGRAMS order: 16 x u64 bucket counts, f64 sum
   +2136  40   reserved

Version 1 (until 2026-12) had a 320-byte ring section, 896-byte records with
12 counters and two histograms, and the rings in another order. A reader of
one version refuses a segment of the other (:class:`ShmLayoutError`, naming
both versions) rather than misreading it.
"""

from __future__ import annotations

from struct import Struct

from awa_fast.errors import AwaFastError
from awa_fast.runtime.shm.histogram import HIST_BUCKETS, SIZE_BUCKETS

__all__ = [
    "CLAIMER_STATES",
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "LAYOUT_VERSION",
    "PRUNE_OUTCOMES",
    "RINGS",
    "RING_FIELDS",
    "ShmError",
    "ShmLayoutError",
    "ShmNotFound",
    "SIZE_HISTOGRAMS",
    "TIME_HISTOGRAMS",
    "TOTALS",
    "segment_size",
]

MAGIC = b"AWAFSHM1"
LAYOUT_VERSION = 2
READ_ATTEMPTS = 16
MAX_CLAIMERS = 4096

# The three rings, in the one order used everywhere: the order the maintenance
# leader rotates and prunes them in, and the order of the ring section.
RINGS = ("claim", "ready", "lease")
CLAIMER_STATES = ("starting", "running", "draining", "stopped")
ROLES = ("unknown", "leader", "standby")

# Counters only go up for the life of the segment (a restarted claimer adds to its record).
COUNTERS = (
    "claimed",
    "completed",
    "retried",
    "failed",
    "cancelled",
    "snoozed",
    "stale",  # completion matched zero rows: the attempt was rescued or closed elsewhere
    "batches_flushed",
    "claim_calls",
    "empty_claims",
    "heartbeat_failures",  # heartbeat batches that failed (connection lost, database error)
)
# Gauges are set, not added, at every publish.
GAUGES = (
    "in_flight",  # claimed here and not yet handed to the batcher (buffered + running)
    "waiting",  # claimed here, handler not started: buffered because every worker slot is busy
    "abandoned",  # sync handlers still running although their attempt was rescued or timed out
)
TIME_HISTOGRAMS = (
    "pickup",  # enqueue commit (database clock) -> handler start
    "e2e",  # enqueue commit -> durable completion
    "handler",  # handler start -> handler return
    "flush_seconds",  # one completion flush, first write to commit
    "claim_seconds",  # one claim call
)
SIZE_HISTOGRAMS = (
    "flush_jobs",  # outcomes written by one completion flush
    "claim_jobs",  # jobs returned by one claim call
)
HISTOGRAMS = TIME_HISTOGRAMS + SIZE_HISTOGRAMS

PRUNE_OUTCOMES = ("pruned", "empty", "busy", "blocked", "current", "retained")
TOTALS = ("promoted", "rescued_receipt", "rescued_lease")
RING_FIELDS = (
    "current_slot",
    "generation",
    "slot_count",
    "last_rotate",
    "last_prune",
    *(f"prune_{o}" for o in PRUNE_OUTCOMES),
    *(f"total_{o}" for o in PRUNE_OUTCOMES),
)
RING_FLOATS = frozenset({"last_rotate", "last_prune"})
QUEUE_BYTES = 64
HOST_BYTES = 32

# -- structs -----------------------------------------------------------------
HEADER = Struct("<8sIIIIIIQdqI4x")
SEQ = Struct("<Q")
F64 = Struct("<d")
U64 = Struct("<Q")
RING_ONE_FMT = "qQQdd" + f"{len(PRUNE_OUTCOMES)}Q" * 2
RING_BODY = Struct("<qQddII32s" + f"{len(TOTALS)}Q" + RING_ONE_FMT * len(RINGS))  # from +8
REC_HEAD = Struct("<64sIIqQdd")  # queue, stripe, state, pid, starts, last alive, state since (at +8)
REC_LIFE = Struct("<IqQdd")  # state, pid, starts, last alive, state since (at +76)
_STATS_FMT = (f"{len(COUNTERS)}Q{len(GAUGES)}Q" + f"{HIST_BUCKETS}Qd" * len(TIME_HISTOGRAMS)
              + f"{SIZE_BUCKETS}Qd" * len(SIZE_HISTOGRAMS))
STATS = Struct("<dd" + _STATS_FMT)  # last alive, state since, counters, gauges, histograms (at +96)
ALIVE_SCALARS = Struct(f"<dd{len(COUNTERS)}Q{len(GAUGES)}Q")  # last alive, state since, counters, gauges (at +96)
TIME_HIST = Struct(f"<{HIST_BUCKETS}Qd")
SIZE_HIST = Struct(f"<{SIZE_BUCKETS}Qd")
REC_ALL = Struct("<Q64sIIqQdd" + _STATS_FMT)

HEADER_SIZE = 64
RING_OFFSET = HEADER_SIZE
RING_SIZE = 512
CLAIMERS_OFFSET = RING_OFFSET + RING_SIZE  # 576
RECORD_SIZE = 2176

# offsets inside a status record
R_QUEUE = 8
R_STATE = 76
R_ALIVE = 96
R_COUNTS = 112
R_GAUGES = R_COUNTS + 8 * len(COUNTERS)
R_HISTS = R_GAUGES + 8 * len(GAUGES)
R_USED = R_HISTS + (8 * HIST_BUCKETS + 8) * len(TIME_HISTOGRAMS) + (8 * SIZE_BUCKETS + 8) * len(SIZE_HISTOGRAMS)
# positions inside STATS.unpack(): 0 alive, 1 since, then counters, gauges, histograms
S_COUNTS = 2
S_GAUGES = S_COUNTS + len(COUNTERS)
S_HISTS = S_GAUGES + len(GAUGES)
# position of each histogram's first bucket inside STATS, and its bucket count; its byte offset in the record
HIST_SLICES: dict[str, tuple[int, int]] = {}
HIST_OFFSETS: dict[str, int] = {}
_pos, _off = S_HISTS, R_HISTS
for _name in HISTOGRAMS:
    _n = HIST_BUCKETS if _name in TIME_HISTOGRAMS else SIZE_BUCKETS
    HIST_SLICES[_name] = (_pos, _n)
    HIST_OFFSETS[_name] = _off
    _pos += _n + 1
    _off += 8 * _n + 8
del _pos, _off, _name, _n

assert HEADER.size == HEADER_SIZE
assert 8 + RING_BODY.size == RING_SIZE
assert REC_HEAD.size == R_COUNTS - R_QUEUE and R_STATE + REC_LIFE.size == R_COUNTS
assert R_ALIVE + STATS.size == R_USED == REC_ALL.size == 2136 and R_ALIVE + ALIVE_SCALARS.size == R_HISTS
assert RECORD_SIZE % 64 == 0 and RECORD_SIZE >= R_USED


def segment_size(claimers: int) -> int:
    """Bytes of a segment with ``claimers`` status records."""
    return CLAIMERS_OFFSET + claimers * RECORD_SIZE


# -- errors ------------------------------------------------------------------
class ShmError(AwaFastError):
    """A shared-memory segment cannot be used (missing, foreign, closed)."""


class ShmNotFound(ShmError, FileNotFoundError):
    """No shared-memory segment has that name (the supervisor is gone?)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no shared-memory segment {name!r} (is the supervisor running?)")


class ShmLayoutError(ShmError, ValueError):
    """The segment exists but is not an awa-fast segment of this layout version."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"shared-memory segment {name!r} is not a usable awa-fast segment: {reason}")
