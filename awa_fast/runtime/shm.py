"""The shared-memory ring: ring state, per-claimer counters and liveness.

The supervisor creates one fixed-layout segment
(:class:`multiprocessing.shared_memory.SharedMemory`; no pickle anywhere);
claimer processes and the maintenance process attach to it by name. It is a
cache and a dashboard: PostgreSQL stays the authority, so a torn or stale
read may cost speed, never correctness.

Writers: every claimer record has exactly one writer process at a time (its
claimer; the supervisor only after that claimer has exited), the ring
section has one (the local maintenance process). Inside a process a
per-record lock serializes threads. Each record starts with a **seqlock**
version counter: a writer makes it odd, writes, then makes it even again;
a reader copies the record between two reads of the counter and retries
while they differ or are odd, up to ``READ_ATTEMPTS`` times, then returns
the last copy with ``torn=True``. A writer that died mid-write leaves the
counter odd; every read of that record is then ``torn`` until the next write.
(Ordering: CPython gives no memory barriers; x86-64 stores and loads are not
reordered with each other, so the check is exact there. On weakly ordered
CPUs a torn read may rarely go undetected - acceptable for a dashboard.)

Claimers accumulate locally and publish once per batch: :meth:`ClaimerRecord.add`
is one seqlock write of all counters, :meth:`ClaimerRecord.observe_latency`
one write of a whole histogram.

Layout (version 1, little-endian, every field at its natural alignment;
times are wall-clock seconds from ``time.time()`` as float64, never
monotonic, so other processes and ``awa-fast status`` can compare them)::

    header, offset 0, 64 bytes (written once by create, magic last)
      0  8s   magic b"AWAFSHM1"
      8  u32  layout version (1)
     12  u32  claimer record count N
     16  u32  header size (64)       = offset of the ring section
     20  u32  ring section size (320)
     24  u32  claimer record size (896)
     28  u32  histogram bucket count (40)
     32  u64  segment size = 384 + N * 896
     40  f64  created at
     48  i64  supervisor pid
     56  8    reserved (0)

    ring section, offset 64, 320 bytes (writer: local maintenance process)
     64  u64  seqlock version
     72  i64  leader pid (0 = unknown)
     80  u64  leader host hash (first 8 bytes of blake2b(host), little-endian)
     88  f64  leader since
     96  f64  last maintenance tick
    104  u32  role of the local maintenance process (0 unknown, 1 leader, 2 standby)
    108  u32  reserved
    112  32s  leader host name, utf-8, NUL padded (truncated to 32 bytes)
    144  80   ring 'ready'     } each ring, 80 bytes:
    224  80   ring 'claim'     }  +0 i64 current slot (-1 = not published yet)
    304  80   ring 'lease'     }  +8 u64 generation, +16 u64 slot count,
                                  +24 f64 last rotate, +32 f64 last prune,
                                  +40 u64 prune_pruned, +48 u64 prune_empty,
                                  +56 u64 prune_busy, +64 u64 prune_blocked,
                                  +72 u64 prune_current  (outcome counts of
                                  the last prune pass of that ring)

    claimer record i, offset 384 + i * 896, 896 bytes (a multiple of 64, so
    two claimers never write the same cache line)
      +0  u64  seqlock version
      +8  64s  queue name, utf-8, NUL padded (longer names: first 55 bytes,
               "~", 8 hex digits of blake2b of the full name)
     +72  u32  stripe index
     +76  u32  state (0 starting, 1 running, 2 draining, 3 stopped)
     +80  i64  pid (0 = never started)
     +88  u64  starts (times the state was set to 'starting')
     +96  f64  last alive (refreshed by every write)
    +104  f64  state since
    +112  12 x u64 counters: claimed, completed, retried, failed, cancelled,
               snoozed, waiting (parked for a callback), stale (completion
               matched zero rows), in_flight (a gauge), batches_flushed,
               claim_calls, empty_claims
    +208  pickup latency histogram: 40 x u64 bucket counts, f64 sum (s)
    +536  end-to-end latency histogram: 40 x u64 bucket counts, f64 sum (s)
    +864  32   reserved

Histogram buckets (:func:`bucket_bounds`): 39 upper edges
``edge[i] = 50e-6 * (60 / 50e-6) ** (i / 38)``, i = 0..38, from 50 us to 60 s
(each about 1.445x the previous). Bucket 0 holds ``x <= 50 us`` (and
non-positive or NaN samples, counted as 0 s), bucket i holds
``edge[i-1] < x <= edge[i]``, bucket 39 holds ``x > 60 s``.

Finding the segments of local supervisors: each supervisor writes its own
``$AWA_FAST_HOME/run/<schema>.<pid>.json`` = ``{"shm": name, "pid": pid,
"started": time}`` and removes only its own (:func:`write_locator`,
:func:`read_locators`, :func:`read_locator`, :func:`remove_locator`).

Segments of killed supervisors: default names carry the owner's pid, start
time and namespace scope (:func:`segment_name`); a starting supervisor calls
:func:`sweep_dead_segments`, which unlinks those whose owner is provably dead.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import secrets
import socket
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory as _shm_mod
from struct import Struct
from typing import Any

from awa_fast.errors import AwaFastError
from awa_fast.storage.schema import validate_schema

__all__ = [
    "CLAIMER_STATES",
    "COUNTERS",
    "HIST_BUCKETS",
    "RINGS",
    "ClaimerRecord",
    "RingSnapshot",
    "RingState",
    "ShmError",
    "ShmLayoutError",
    "ShmNotFound",
    "ShmRing",
    "bucket_bounds",
    "bucket_index",
    "histogram_percentiles",
    "prune_outcome_counts",
    "read_locator",
    "read_locators",
    "remove_locator",
    "segment_name",
    "segment_owner",
    "sweep_dead_segments",
    "write_locator",
]

log = logging.getLogger("awa_fast.shm")

MAGIC = b"AWAFSHM1"
LAYOUT_VERSION = 1
READ_ATTEMPTS = 16
MAX_CLAIMERS = 4096

RINGS = ("ready", "claim", "lease")
CLAIMER_STATES = ("starting", "running", "draining", "stopped")
ROLES = ("unknown", "leader", "standby")
COUNTERS = (
    "claimed",
    "completed",
    "retried",
    "failed",
    "cancelled",
    "snoozed",
    "waiting",
    "stale",
    "in_flight",
    "batches_flushed",
    "claim_calls",
    "empty_claims",
)
RING_FIELDS = (
    "current_slot",
    "generation",
    "slot_count",
    "last_rotate",
    "last_prune",
    "prune_pruned",
    "prune_empty",
    "prune_busy",
    "prune_blocked",
    "prune_current",
)
_RING_FLOATS = frozenset({"last_rotate", "last_prune"})

HIST_BUCKETS = 40
HIST_LOW = 50e-6
HIST_HIGH = 60.0
HISTOGRAMS = ("pickup", "e2e")
QUEUE_BYTES = 64
HOST_BYTES = 32

# -- layout ------------------------------------------------------------------
_HEADER = Struct("<8sIIIIIIQdq8x")
_SEQ = Struct("<Q")
_RING_HEAD = Struct("<qQddII32s")
_RING_ONE = Struct("<qQQddQQQQQ")
_RING_BODY = Struct("<qQddII32s" + "qQQddQQQQQ" * len(RINGS))
_REC_HEAD = Struct("<64sIIqQdd")
_COUNTS = Struct(f"<{len(COUNTERS)}Q")
_HIST = Struct(f"<{HIST_BUCKETS}Qd")
_REC_ALL = Struct("<Q64sIIqQdd" + f"{len(COUNTERS)}Q" + f"{HIST_BUCKETS}Qd" * len(HISTOGRAMS))
_REC_LIFE = Struct("<IqQdd")  # state, pid, starts, last alive, state since (at +76)
_ALIVE_COUNTS = Struct(f"<dd{len(COUNTERS)}Q")  # last alive, state since, counters (at +96)
_F64 = Struct("<d")
_U64 = Struct("<Q")

HEADER_SIZE = 64
RING_OFFSET = HEADER_SIZE
RING_SIZE = 320
CLAIMERS_OFFSET = RING_OFFSET + RING_SIZE  # 384
RECORD_SIZE = 896

# offsets inside a claimer record
_R_QUEUE = 8
_R_STATE = 76
_R_ALIVE = 96
_R_COUNTS = 112
_R_IN_FLIGHT = _R_COUNTS + 8 * COUNTERS.index("in_flight")
_R_HIST = {"pickup": 208, "e2e": 536}
_R_USED = 864

assert _HEADER.size == HEADER_SIZE
assert 8 + _RING_BODY.size == RING_SIZE and _RING_HEAD.size == 72 and _RING_ONE.size == 80
assert _REC_HEAD.size == _R_COUNTS - _R_QUEUE and _R_COUNTS + _COUNTS.size == _R_HIST["pickup"]
assert _R_HIST["pickup"] + _HIST.size == _R_HIST["e2e"] and _R_HIST["e2e"] + _HIST.size == _R_USED
assert _R_STATE + _REC_LIFE.size == _R_COUNTS and _R_ALIVE + _ALIVE_COUNTS.size == _R_HIST["pickup"]
assert _REC_ALL.size == _R_USED and RECORD_SIZE % 64 == 0 and RECORD_SIZE >= _R_USED

_SHM_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def segment_size(claimers: int) -> int:
    """Bytes of a segment with ``claimers`` claimer records."""
    return CLAIMERS_OFFSET + claimers * RECORD_SIZE


# -- errors ------------------------------------------------------------------
class ShmError(AwaFastError):
    """A shared-memory ring cannot be used (missing, foreign, closed)."""


class ShmNotFound(ShmError, FileNotFoundError):
    """No shared-memory segment has that name (the supervisor is gone?)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no shared-memory segment {name!r} (is the supervisor running?)")


class ShmLayoutError(ShmError, ValueError):
    """The segment exists but is not an awa-fast ring of this layout version."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"shared-memory segment {name!r} is not a usable awa-fast ring: {reason}")


# -- histogram math ------------------------------------------------------------
def bucket_bounds(buckets: int = HIST_BUCKETS, low: float = HIST_LOW, high: float = HIST_HIGH) -> tuple[float, ...]:
    """Upper edges (seconds) of buckets ``0 .. buckets-2``; the last bucket is open.

    ``edge[i] = low * (high / low) ** (i / (buckets - 2))``: log-spaced from
    ``low`` to ``high`` inclusive.
    """
    n = buckets - 2
    return tuple(low * (high / low) ** (i / n) for i in range(n + 1))


_EDGES = bucket_bounds()
_LAST = HIST_BUCKETS - 1
_BUCKET_OF = functools.partial(bisect.bisect_left, _EDGES)


def bucket_index(seconds: float) -> int:
    """The histogram bucket of one sample (non-positive and NaN go to bucket 0)."""
    if seconds > 0.0:
        return bisect.bisect_left(_EDGES, seconds)
    return 0


def histogram_percentiles(counts: Sequence[int], qs: Sequence[float] = (0.5, 0.95, 0.99)) -> dict[str, float | None]:
    """Percentiles (seconds) from bucket counts, linearly interpolated inside a bucket.

    Bucket 0 spans 0..50 us; the open last bucket reports its lower edge
    (60 s). Keys are ``p50``, ``p95``, ``p99.9`` ...; values are None when
    the histogram is empty.
    """
    if len(counts) != len(_EDGES) + 1:
        raise ValueError(f"expected {len(_EDGES) + 1} bucket counts, got {len(counts)}")
    total = sum(counts)
    out: dict[str, float | None] = {}
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q!r} is not within 0..1")
        key = f"p{q * 100:g}"
        if total == 0:
            out[key] = None
            continue
        rank = q * total
        cum = 0
        value = _EDGES[-1]
        for i, c in enumerate(counts):
            if c and cum + c >= rank:
                if i == _LAST:
                    value = _EDGES[-1]
                else:
                    lo = _EDGES[i - 1] if i else 0.0
                    value = lo + (_EDGES[i] - lo) * max(rank - cum, 0.0) / c
                break
            cum += c
        out[key] = value
    return out


def prune_outcome_counts(outcomes: Sequence[str]) -> dict[str, int]:
    """Fold ``ring_prune`` results into the ``prune_*`` fields of one ring.

    'pruned', 'empty', 'busy' and 'current' count as themselves; any gate
    name ('pending_ready', 'open_claims', 'cursor_behind', 'active_leases')
    counts as ``prune_blocked``.
    """
    out = {"prune_pruned": 0, "prune_empty": 0, "prune_busy": 0, "prune_blocked": 0, "prune_current": 0}
    for outcome in outcomes:
        key = f"prune_{outcome}"
        out[key if key in out and key != "prune_blocked" else "prune_blocked"] += 1
    return out


# -- small helpers -------------------------------------------------------------
def _fixed_text(text: str, size: int) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) <= size:
        return raw
    tag = "~" + hashlib.blake2b(raw, digest_size=4).hexdigest()
    head = raw[: size - len(tag)].decode("utf-8", "ignore")
    return (head + tag).encode("utf-8")


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _host_hash(host: str) -> int:
    return int.from_bytes(hashlib.blake2b(host.encode("utf-8"), digest_size=8).digest(), "little")


def _odd_version(buf: memoryview, off: int) -> int:
    """The odd version that opens the next write (also past a writer that died mid-write)."""
    seq: int = _SEQ.unpack_from(buf, off)[0]
    return seq + 2 if seq & 1 else seq + 1


def _read_consistent(buf: memoryview, off: int, size: int) -> tuple[bytes, bool]:
    """Copy ``size`` bytes at ``off`` (seqlock version first); return (bytes, torn)."""
    data = b""
    for attempt in range(READ_ATTEMPTS):
        before = _SEQ.unpack_from(buf, off)[0]
        data = bytes(buf[off : off + size])
        if not before & 1 and _SEQ.unpack_from(buf, off)[0] == before:
            return data, False
        if attempt >= 3:
            os.sched_yield()
    return data, True


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


# -- segment names: who owns a segment, and sweeping those of dead owners ---------
# A supervisor killed with SIGKILL (with its whole process group, resource
# tracker included) never unlinks its segment. So the default name says who
# created it: ``awa_fast_<pid>_<start>_<scope>_<random>``, where <start> is the
# creator's start time (field 22 of /proc/<pid>/stat, clock ticks since boot)
# and <scope> 16 hex digits of blake2b over the pid namespace, the time
# namespace (it offsets <start>) and the boot id. (pid, start) names one
# process for the lifetime of the system, even after its pid is reused; the
# scope says whether this process can see that pid at all. A new supervisor
# removes such segments when their owner is *provably* dead: same scope, same
# effective uid, and either no process has that pid (ESRCH) or the process that
# has it started at another time. Anything else (another namespace or boot,
# another user, /proc unreadable, a zombie, the old ``awa_fast_<pid>_<random>``
# names, names given explicitly) is left alone.
SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps POSIX shared memory
_OWNED_NAME_RE = re.compile(r"awa_fast_([1-9][0-9]{0,9})_([0-9]{1,20})_([0-9a-f]{16})_[0-9a-f]{8}")


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # the command name (field 2) may hold spaces and parentheses: count from its closing ')'
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner_scope() -> str | None:
    """Hex digest naming this process's pid namespace, time namespace and boot; None if unknown."""
    try:
        with open("/proc/self/stat", "rb") as f:
            if int(f.read().split(b" ", 1)[0]) != os.getpid():
                return None  # /proc belongs to another pid namespace: its pids are not ours
        pidns = os.stat("/proc/self/ns/pid")
        try:
            timens = os.stat("/proc/self/ns/time")
            time_key = f"{timens.st_dev}:{timens.st_ino}"
        except FileNotFoundError:  # kernel without time namespaces: nobody's start time is offset
            time_key = "-"
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except (OSError, ValueError):
        return None
    if not boot:
        return None
    key = f"pid={pidns.st_dev}:{pidns.st_ino} time={time_key} boot={boot}"
    return hashlib.blake2b(key.encode("ascii"), digest_size=8).hexdigest()


def segment_name(pid: int | None = None) -> str:
    """A fresh segment name tagged with its owner (default: this process).

    ``awa_fast_<pid>_<start>_<scope>_<8 hex>``; when the owner's start time
    or this process's scope cannot be read, the untagged
    ``awa_fast_<pid>_<8 hex>``, which no sweep ever removes.
    """
    pid = os.getpid() if pid is None else pid
    start = _proc_start_time(pid)
    scope = _owner_scope()
    if start is None or scope is None:
        return f"awa_fast_{pid}_{secrets.token_hex(4)}"
    return f"awa_fast_{pid}_{start}_{scope}_{secrets.token_hex(4)}"


def segment_owner(name: str) -> tuple[int, int, str] | None:
    """``(pid, start_ticks, scope)`` of a tagged segment name; None for any other name."""
    m = _OWNED_NAME_RE.fullmatch(name)
    if m is None:
        return None
    return int(m[1]), int(m[2]), m[3]


def _owner_alive(pid: int, start: int) -> bool | None:
    """True: alive; False: provably dead; None: cannot tell. ``pid`` must be in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False  # no process has this pid
    except PermissionError:
        pass  # it exists (another user's)
    except (OSError, OverflowError):
        return None
    now = _proc_start_time(pid)
    if now is None:  # exited between the two looks, or hidden from us (hidepid)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except (OSError, OverflowError):
            pass
        return None
    return now == start  # another start time: the pid was reused, the owner is gone


def sweep_dead_segments() -> list[str]:
    """Unlink the tagged segments (see :func:`segment_name`) whose owner is provably dead.

    Only segments of this effective uid and of this process's scope (pid and
    time namespace, boot) are considered; a live or undeterminable owner keeps
    its segment. Each removal is logged at INFO. Returns the removed names.
    Unlinking only removes the name: a process still mapping the segment
    keeps its memory until it unmaps it.
    """
    scope = _owner_scope()
    if scope is None:
        log.debug("not sweeping %s: this process's pid namespace or boot cannot be identified", SHM_DIR)
        return []
    uid = os.geteuid()
    swept: list[str] = []
    try:
        entries = os.scandir(SHM_DIR)
    except OSError:
        return swept
    with entries:
        for entry in entries:
            owner = segment_owner(entry.name)
            if owner is None or owner[2] != scope:
                continue
            pid, start, _ = owner
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            if _owner_alive(pid, start) is not False:
                continue
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue  # another supervisor swept it first
            except OSError as exc:
                log.warning("cannot remove shared-memory segment %s of dead supervisor %d: %s", entry.name, pid, exc,
                            extra={"action": "shm_sweep_failed"})
                continue
            log.info("removed shared-memory segment %s left by dead supervisor %d (%d bytes)", entry.name, pid,
                     st.st_size, extra={"action": "shm_swept"})
            swept.append(entry.name)
    return swept


# -- resource_tracker (bpo-39959) ------------------------------------------------
# Before Python 3.13, SharedMemory(name) registers the segment with the
# process's resource_tracker even when it only attaches, and the tracker
# unlinks every still-registered segment when it exits. So an attaching
# process (``awa-fast status``, a spawned claimer with its own tracker) would
# destroy the supervisor's segment at exit. The usual fix, calling
# resource_tracker.unregister() right after attaching, is wrong here: a forked
# (and a multiprocessing-spawned) child shares its parent's tracker, whose
# registry is a set, so the child's unregister drops the *creator's*
# registration (the segment then leaks if the supervisor crashes) and the
# creator's own unlink later makes the tracker print a KeyError traceback
# (verified on 3.11.7). Correct is not registering at all: ``track=False``
# on 3.13+, and on 3.11/3.12 a stand-in for the module's ``resource_tracker``
# name during the one constructor call that skips only this segment's name
# and delegates everything else (other threads creating other segments at
# that moment are still tracked). A lock serializes those swaps.
_TRACKER_LOCK = threading.Lock()


class _SkipOne:
    """Proxy of ``multiprocessing.resource_tracker`` that ignores one shm name."""

    def __init__(self, real: Any, skip: str) -> None:
        self._real = real
        self._skip = skip

    def register(self, name: str, rtype: str) -> None:
        if not (rtype == "shared_memory" and name == self._skip):
            self._real.register(name, rtype)

    def unregister(self, name: str, rtype: str) -> None:
        if not (rtype == "shared_memory" and name == self._skip):
            self._real.unregister(name, rtype)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real, attr)


def _untracked(name: str, action: Any) -> Any:
    with _TRACKER_LOCK:
        real = _shm_mod.resource_tracker
        _shm_mod.resource_tracker = _SkipOne(real, "/" + name)  # type: ignore[assignment]
        try:
            return action()
        finally:
            _shm_mod.resource_tracker = real


def _attach_untracked(name: str) -> _shm_mod.SharedMemory:
    if sys.version_info >= (3, 13):
        return _shm_mod.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    return _untracked(name, lambda: _shm_mod.SharedMemory(name=name))  # type: ignore[no-any-return]


# -- the ring ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RingState:
    """One ring as last published by the maintenance process."""

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


@dataclass(frozen=True, slots=True)
class RingSnapshot:
    """The ring section: leader identity and the three rings; ``torn`` if unverified."""

    leader_pid: int
    leader_host: str
    leader_host_hash: int
    leader_since: float
    last_tick: float
    role: str
    rings: dict[str, RingState]
    torn: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


class ClaimerRecord:
    """One claimer's record. One writer process at a time; threads are serialized."""

    __slots__ = ("_ring", "_off", "_lock", "index")

    def __init__(self, ring: ShmRing, index: int) -> None:
        self._ring = ring
        self.index = index
        self._off = CLAIMERS_OFFSET + index * RECORD_SIZE
        self._lock = threading.Lock()

    def _buf(self) -> memoryview:
        buf = self._ring._buf
        if buf is None:
            raise ShmError(f"shared-memory ring {self._ring.name!r} is closed")
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
            _, old_pid, starts, _, _ = _REC_LIFE.unpack_from(buf, off + _R_STATE)
            if state == "starting":
                old_pid = os.getpid() if pid is None else pid
                starts += 1
            elif pid is not None:
                old_pid = pid
            seq = _odd_version(buf, off)
            _SEQ.pack_into(buf, off, seq)
            _REC_LIFE.pack_into(buf, off + _R_STATE, code, old_pid, starts, now, now)
            _SEQ.pack_into(buf, off, seq + 1)

    def heartbeat(self) -> None:
        """Refresh last-alive (every other write refreshes it too)."""
        buf = self._buf()
        off = self._off
        now = time.time()
        with self._lock:
            seq = _odd_version(buf, off)
            _SEQ.pack_into(buf, off, seq)
            _F64.pack_into(buf, off + _R_ALIVE, now)
            _SEQ.pack_into(buf, off, seq + 1)

    def add(
        self,
        *,
        claimed: int = 0,
        completed: int = 0,
        retried: int = 0,
        failed: int = 0,
        cancelled: int = 0,
        snoozed: int = 0,
        waiting: int = 0,
        stale: int = 0,
        batches: int = 0,
        claim_calls: int = 0,
        empty_claims: int = 0,
    ) -> None:
        """Add to the counters (``batches`` goes to batches_flushed) in one seqlock write."""
        buf = self._buf()
        off = self._off
        now = time.time()
        with self._lock:
            # single writer: its own fields need no seqlock to read
            _, since, *c = _ALIVE_COUNTS.unpack_from(buf, off + _R_ALIVE)
            seq = _odd_version(buf, off)
            _SEQ.pack_into(buf, off, seq)
            _ALIVE_COUNTS.pack_into(
                buf,
                off + _R_ALIVE,
                now,
                since,
                c[0] + claimed,
                c[1] + completed,
                c[2] + retried,
                c[3] + failed,
                c[4] + cancelled,
                c[5] + snoozed,
                c[6] + waiting,
                c[7] + stale,
                c[8],
                c[9] + batches,
                c[10] + claim_calls,
                c[11] + empty_claims,
            )
            _SEQ.pack_into(buf, off, seq + 1)

    def set_in_flight(self, n: int) -> None:
        """Set the in-flight gauge (jobs claimed and not yet handed to the batcher)."""
        buf = self._buf()
        off = self._off
        now = time.time()
        with self._lock:
            seq = _odd_version(buf, off)
            _SEQ.pack_into(buf, off, seq)
            _U64.pack_into(buf, off + _R_IN_FLIGHT, max(n, 0))
            _F64.pack_into(buf, off + _R_ALIVE, now)
            _SEQ.pack_into(buf, off, seq + 1)

    def observe_latency(self, which: str, seconds_list: Sequence[float]) -> None:
        """Add samples (seconds) to the 'pickup' or 'e2e' histogram in one seqlock write."""
        hoff = _R_HIST.get(which)
        if hoff is None:
            raise ValueError(f"unknown histogram {which!r}; use one of {HISTOGRAMS}")
        if not seconds_list:
            return
        inc = [0] * HIST_BUCKETS
        # C loops: bisect per sample, Counter tallies (NaN/negative -> 0, +inf -> last)
        for i, n in Counter(map(_BUCKET_OF, seconds_list)).items():
            inc[i] = n
        total = sum(seconds_list)
        if not 0.0 <= total < math.inf or min(seconds_list) < 0.0:
            total = sum(s for s in seconds_list if 0.0 < s < math.inf)
        buf = self._buf()
        off = self._off
        now = time.time()
        with self._lock:
            old = _HIST.unpack_from(buf, off + hoff)
            new = [a + b for a, b in zip(old, inc)]
            new.append(old[HIST_BUCKETS] + total)
            seq = _odd_version(buf, off)
            _SEQ.pack_into(buf, off, seq)
            _HIST.pack_into(buf, off + hoff, *new)
            _F64.pack_into(buf, off + _R_ALIVE, now)
            _SEQ.pack_into(buf, off, seq + 1)

    def read(self) -> dict[str, Any]:
        """The record as a plain dict (counters, histograms with percentiles, ``torn``)."""
        data, torn = _read_consistent(self._buf(), self._off, _R_USED)
        v = _REC_ALL.unpack(data)
        state = v[3]
        out: dict[str, Any] = {
            "index": self.index,
            "queue": _text(v[1]),
            "stripe": v[2],
            "state": CLAIMER_STATES[state] if state < len(CLAIMER_STATES) else f"unknown({state})",
            "pid": v[4],
            "starts": v[5],
            "last_alive": v[6],
            "state_since": v[7],
        }
        n = len(COUNTERS)
        out.update(zip(COUNTERS, v[8 : 8 + n]))
        pos = 8 + n
        for which in HISTOGRAMS:
            counts = list(v[pos : pos + HIST_BUCKETS])
            total = sum(counts)
            out[which] = {
                "count": total,
                "sum": v[pos + HIST_BUCKETS],
                "mean": v[pos + HIST_BUCKETS] / total if total else None,
                **histogram_percentiles(counts),
                "buckets": counts,
            }
            pos += HIST_BUCKETS + 1
        out["torn"] = torn
        return out


class ShmRing:
    """The supervisor's shared-memory segment: create it once, attach by name."""

    name: str

    def __init__(self, shm: _shm_mod.SharedMemory, name: str, claimers: int, creator: bool) -> None:
        self._shm: _shm_mod.SharedMemory | None = shm
        self._buf: memoryview | None = shm.buf
        self.name = name
        self.claimers = claimers
        self._creator_pid = os.getpid() if creator else 0
        self._records = [ClaimerRecord(self, i) for i in range(claimers)]
        self._ring_lock = threading.Lock()

    @classmethod
    def create(cls, name: str | None, claimers: Sequence[tuple[str, int]]) -> ShmRing:
        """Create a segment with one record per ``(queue, stripe)``; ``name=None`` picks :func:`segment_name`."""
        n = len(claimers)
        if not 0 <= n <= MAX_CLAIMERS:
            raise ValueError(f"{n} claimers; at most {MAX_CLAIMERS}")
        if name is None:
            name = segment_name()  # tagged with this process, so a sweep can tell when it is dead
        elif not _SHM_NAME_RE.fullmatch(name):
            raise ValueError(f"shared-memory name {name!r}: use 1-200 of letters, digits, _ . -")
        size = segment_size(n)
        try:
            shm = _shm_mod.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            raise ShmError(f"shared-memory segment {name!r} already exists") from None
        buf = shm.buf
        now = time.time()
        for i, (queue, stripe) in enumerate(claimers):
            off = CLAIMERS_OFFSET + i * RECORD_SIZE
            _REC_HEAD.pack_into(
                buf, off + _R_QUEUE, _fixed_text(queue, QUEUE_BYTES), stripe, CLAIMER_STATES.index("stopped"), 0, 0, 0.0, now
            )
        ring_init: list[Any] = [0, 0, 0.0, 0.0, 0, 0, b""]
        for _ in RINGS:
            ring_init += [-1, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0]
        _RING_BODY.pack_into(buf, RING_OFFSET + 8, *ring_init)
        _HEADER.pack_into(
            buf, 0, b"\0" * 8, LAYOUT_VERSION, n, HEADER_SIZE, RING_SIZE, RECORD_SIZE, HIST_BUCKETS, size, now, os.getpid()
        )
        buf[0:8] = MAGIC  # last: an attacher never sees a half-initialised header as valid
        return cls(shm, name, n, creator=True)

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        """Attach to an existing segment (not tracked for unlink); validate its header."""
        if not _SHM_NAME_RE.fullmatch(name):
            raise ShmLayoutError(name, "not a valid awa-fast segment name")
        try:
            shm = _attach_untracked(name)
        except FileNotFoundError:
            raise ShmNotFound(name) from None
        except ValueError as exc:  # mmap of an empty segment
            raise ShmLayoutError(name, f"cannot map it ({exc})") from None
        try:
            n = cls._validate(name, shm)
        except ShmLayoutError:
            shm.close()
            raise
        return cls(shm, name, n, creator=False)

    @staticmethod
    def _validate(name: str, shm: _shm_mod.SharedMemory) -> int:
        if shm.size < HEADER_SIZE:
            raise ShmLayoutError(name, f"only {shm.size} bytes, smaller than the {HEADER_SIZE}-byte header")
        magic, version, n, hsize, rsize, recsize, buckets, size, _, _ = _HEADER.unpack_from(shm.buf, 0)
        if magic != MAGIC:
            raise ShmLayoutError(name, f"magic {magic!r}, expected {MAGIC!r}")
        if version != LAYOUT_VERSION:
            raise ShmLayoutError(name, f"layout version {version}, this awa-fast reads {LAYOUT_VERSION}")
        if (hsize, rsize, recsize, buckets) != (HEADER_SIZE, RING_SIZE, RECORD_SIZE, HIST_BUCKETS):
            raise ShmLayoutError(name, f"section sizes {(hsize, rsize, recsize, buckets)} do not match layout {version}")
        if n > MAX_CLAIMERS or size != segment_size(n):
            raise ShmLayoutError(name, f"header says {n} claimers and {size} bytes, which do not agree")
        if shm.size < size:
            raise ShmLayoutError(name, f"segment has {shm.size} bytes, header says {size}")
        return int(n)

    def close(self) -> None:
        """Unmap the segment in this process (idempotent); records become unusable."""
        shm, self._shm, self._buf = self._shm, None, None
        if shm is not None:
            shm.close()

    def unlink(self) -> None:
        """Remove the segment name (the creator does this at shutdown); idempotent."""
        try:
            if self._creator_pid == os.getpid():  # registered at create: unregister too
                self._shm_or_attach().unlink()
            else:  # not registered here: keep the tracker out of it
                shm = self._shm_or_attach()
                if sys.version_info >= (3, 13):
                    shm.unlink()
                else:
                    _untracked(self.name, shm.unlink)
        except FileNotFoundError:
            pass

    def _shm_or_attach(self) -> _shm_mod.SharedMemory:
        if self._shm is not None:
            return self._shm
        shm = _attach_untracked(self.name)
        shm.close()
        return shm

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _buffer(self) -> memoryview:
        if self._buf is None:
            raise ShmError(f"shared-memory ring {self.name!r} is closed")
        return self._buf

    # -- header, claimers ---------------------------------------------------
    def header(self) -> dict[str, Any]:
        """Header fields as a dict."""
        _, version, n, _, _, _, buckets, size, created, pid = _HEADER.unpack_from(self._buffer(), 0)
        return {
            "layout_version": version,
            "claimers": n,
            "segment_size": size,
            "created_at": created,
            "supervisor_pid": pid,
            "histogram_buckets": buckets,
        }

    def claimer(self, index: int) -> ClaimerRecord:
        """The record of claimer ``index`` (same object for every call in this process)."""
        if not 0 <= index < self.claimers:
            raise IndexError(f"claimer index {index} out of range 0..{self.claimers - 1}")
        return self._records[index]

    # -- ring section ---------------------------------------------------------
    def publish_rings(
        self,
        rings: Mapping[str, Mapping[str, int | float]],
        leader_pid: int,
        *,
        leader_host: str | None = None,
        leader_since: float | None = None,
        tick: float | None = None,
        role: str = "leader",
    ) -> None:
        """Publish ring state (fields not given keep their values) in one seqlock write.

        ``rings`` maps 'ready'/'claim'/'lease' to any of :data:`RING_FIELDS`
        (see :func:`prune_outcome_counts`). ``leader_host`` defaults to this
        host, ``tick`` to now; ``leader_since`` None keeps the stored value.
        """
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {ROLES}")
        for ring, fields in rings.items():
            if ring not in RINGS:
                raise ValueError(f"unknown ring {ring!r}; use one of {RINGS}")
            bad = set(fields) - set(RING_FIELDS)
            if bad:
                raise ValueError(f"unknown ring fields {sorted(bad)}; use {RING_FIELDS}")
        host = socket.gethostname() if leader_host is None else leader_host
        buf = self._buffer()
        with self._ring_lock:
            v = list(_RING_BODY.unpack_from(buf, RING_OFFSET + 8))
            v[0] = leader_pid
            v[1] = _host_hash(host)
            if leader_since is not None:
                v[2] = leader_since
            v[3] = time.time() if tick is None else tick
            v[4] = ROLES.index(role)
            v[6] = _fixed_text(host, HOST_BYTES)
            for r, ring in enumerate(RINGS):
                fields = rings.get(ring)
                if fields:
                    base = 7 + r * len(RING_FIELDS)
                    for i, key in enumerate(RING_FIELDS):
                        if key in fields:
                            value = fields[key]
                            v[base + i] = float(value) if key in _RING_FLOATS else int(value)
            seq = _odd_version(buf, RING_OFFSET)
            _SEQ.pack_into(buf, RING_OFFSET, seq)
            _RING_BODY.pack_into(buf, RING_OFFSET + 8, *v)
            _SEQ.pack_into(buf, RING_OFFSET, seq + 1)

    def read_rings(self) -> RingSnapshot:
        """The ring section as a :class:`RingSnapshot`."""
        data, torn = _read_consistent(self._buffer(), RING_OFFSET, RING_SIZE)
        v = _RING_BODY.unpack_from(data, 8)
        rings = {}
        for r, ring in enumerate(RINGS):
            base = 7 + r * len(RING_FIELDS)
            rings[ring] = RingState(*v[base : base + len(RING_FIELDS)])
        role = v[4]
        return RingSnapshot(
            leader_pid=v[0],
            leader_host=_text(v[6]),
            leader_host_hash=v[1],
            leader_since=v[2],
            last_tick=v[3],
            role=ROLES[role] if role < len(ROLES) else f"unknown({role})",
            rings=rings,
            torn=torn,
        )

    def snapshot(self) -> dict[str, Any]:
        """The whole segment as a plain JSON-able dict (``awa-fast status --json``)."""
        header = self.header()
        return {
            "name": self.name,
            "now": time.time(),
            **header,
            "supervisor_alive": _pid_alive(header["supervisor_pid"]),
            "histogram_bounds": list(_EDGES),
            "maintenance": self.read_rings().to_dict(),
            "claimers": [rec.read() for rec in self._records],
        }


# -- locator -------------------------------------------------------------------
# One file per supervisor, ``<home>/run/<schema>.<pid>.json``: two supervisors
# of one schema on one host (a rolling restart, two apps) each keep their own,
# and the first to exit removes only its own. Schema names hold no '.', so the
# pattern never matches another schema's files.
def _locator_dir(home: str | os.PathLike[str]) -> pathlib.Path:
    return pathlib.Path(home) / "run"


def _locator_path(home: str | os.PathLike[str], schema: str, pid: int) -> pathlib.Path:
    return _locator_dir(home) / f"{validate_schema(schema)}.{int(pid)}.json"


def _read_one(path: pathlib.Path) -> tuple[str, int, float] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        name, pid, started = data["shm"], data["pid"], data.get("started", 0.0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(name, str) or not isinstance(pid, int) or isinstance(pid, bool) \
            or not isinstance(started, (int, float)):
        return None
    return name, pid, float(started)


def _locator_files(home: str | os.PathLike[str], schema: str) -> list[pathlib.Path]:
    validate_schema(schema)
    d = _locator_dir(home)
    # <schema>.json: the single locator of earlier versions, still read while such a supervisor runs
    return sorted([*d.glob(f"{schema}.[0-9]*.json"), d / f"{schema}.json"])


def write_locator(home: str | os.PathLike[str], schema: str, name: str, pid: int) -> pathlib.Path:
    """Write ``<home>/run/<schema>.<pid>.json`` = ``{"shm": name, "pid": pid, "started": t}`` atomically.

    Locators of this schema whose supervisor is dead (killed with SIGKILL)
    are removed on the way.
    """
    path = _locator_path(home, schema, pid)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for other in _locator_files(home, schema):
        found = _read_one(other)
        if other != path and found is not None and not _pid_alive(found[1]):
            try:
                other.unlink()
            except OSError:
                pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"shm": name, "pid": pid, "started": time.time()}), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_locators(home: str | os.PathLike[str], schema: str) -> list[tuple[str, int]]:
    """``(name, pid)`` of every live local supervisor of ``schema``, oldest first."""
    live = []
    for path in _locator_files(home, schema):
        found = _read_one(path)
        if found is not None and _pid_alive(found[1]):
            live.append(found)
    live.sort(key=lambda f: (f[2], f[1]))
    seen: set[str] = set()
    out = []
    for name, pid, _ in live:
        if name not in seen:
            seen.add(name)
            out.append((name, pid))
    return out


def read_locator(home: str | os.PathLike[str], schema: str) -> tuple[str, int] | None:
    """``(name, pid)`` of the oldest live local supervisor of ``schema`` (see :func:`read_locators`); else None."""
    found = read_locators(home, schema)
    return found[0] if found else None


def remove_locator(home: str | os.PathLike[str], schema: str, name: str | None = None,
                   pid: int | None = None) -> bool:
    """Remove the locator of supervisor ``pid`` (default: this process), never another's.

    With ``name``, only if it still names that segment. True if removed.
    """
    path = _locator_path(home, schema, os.getpid() if pid is None else pid)
    if name is not None:
        found = _read_one(path)
        if found is None or found[0] != name:
            return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
