"""The segment: create it once (the supervisor), attach to it by name (claimers, maintenance, status).

:class:`ShmSegment` is one fixed-layout
:class:`multiprocessing.shared_memory.SharedMemory` (no pickle anywhere;
layout in :mod:`awa_fast.runtime.shm.layout`) with two sections: the
**ring section**, which the local maintenance process publishes (leader,
ring positions, prune outcomes, maintenance totals), and one **status
record** per claimer. It is a cache and a dashboard: PostgreSQL stays the
authority, so a torn or stale read may cost speed, never correctness.

Segments of killed supervisors: default names carry the owner's pid, start
time and namespace scope (:func:`segment_name`); a starting supervisor calls
:func:`sweep_dead_segments`, which unlinks those whose owner is provably dead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import socket
import stat
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory as _shm_mod
from typing import Any

from awa_fast.runtime.shm.histogram import HIST_BUCKETS, SIZE_BUCKETS, SIZE_EDGES, TIME_EDGES
from awa_fast.runtime.shm.layout import (
    CLAIMER_STATES,
    CLAIMERS_OFFSET,
    HEADER,
    HEADER_SIZE,
    HOST_BYTES,
    LAYOUT_VERSION,
    MAGIC,
    MAX_CLAIMERS,
    PRUNE_OUTCOMES,
    QUEUE_BYTES,
    R_QUEUE,
    REC_HEAD,
    RECORD_SIZE,
    RING_BODY,
    RING_FIELDS,
    RING_FLOATS,
    RING_OFFSET,
    RING_SIZE,
    RINGS,
    ROLES,
    SEQ,
    TOTALS,
    ShmError,
    ShmLayoutError,
    ShmNotFound,
    segment_size,
)
from awa_fast.runtime.shm.records import (
    RingSnapshot,
    RingState,
    StatusRecord,
    fixed_text,
    host_hash,
    odd_version,
    pid_alive,
    read_consistent,
    text_of,
)

__all__ = ["ShmSegment", "segment_name", "segment_owner", "sweep_dead_segments"]

log = logging.getLogger("awa_fast.shm")

_SHM_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_RING_HEAD_LEN = 7 + len(TOTALS)  # pid, host hash, since, tick, role, reserved, host, totals
_TOTAL_FIELDS = tuple(f for f in RING_FIELDS if f.startswith("total_"))


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
    # shared_memory's module-level `resource_tracker` (its import of multiprocessing.resource_tracker) is what
    # SharedMemory() calls; typeshed does not declare it, hence the attr-defined ignores.
    with _TRACKER_LOCK:
        real = _shm_mod.resource_tracker  # type: ignore[attr-defined]
        _shm_mod.resource_tracker = _SkipOne(real, "/" + name)  # type: ignore[attr-defined]
        try:
            return action()
        finally:
            _shm_mod.resource_tracker = real  # type: ignore[attr-defined]


def _buf_of(shm: _shm_mod.SharedMemory, name: str) -> memoryview:
    buf = shm.buf  # None only once closed
    if buf is None:
        raise ShmError(f"shared-memory segment {name!r} is closed")
    return buf


def _attach_untracked(name: str) -> _shm_mod.SharedMemory:
    if sys.version_info >= (3, 13):
        return _shm_mod.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    return _untracked(name, lambda: _shm_mod.SharedMemory(name=name))  # type: ignore[no-any-return]


# -- the segment -------------------------------------------------------------------
class ShmSegment:
    """The supervisor's shared-memory segment: the ring section and one status record per claimer."""

    name: str

    def __init__(self, shm: _shm_mod.SharedMemory, name: str, claimers: int, creator: bool) -> None:
        self._shm: _shm_mod.SharedMemory | None = shm
        self._buf: memoryview | None = shm.buf
        self.name = name
        self.claimers = claimers
        self._creator_pid = os.getpid() if creator else 0
        self._records = [StatusRecord(self, i) for i in range(claimers)]
        self._ring_lock = threading.Lock()
        self._totals_base: list[int] | None = None  # stored totals when this process first published

    @classmethod
    def create(cls, name: str | None, claimers: Sequence[tuple[str, int]]) -> ShmSegment:
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
        buf = _buf_of(shm, name)
        now = time.time()
        for i, (queue, stripe) in enumerate(claimers):
            off = CLAIMERS_OFFSET + i * RECORD_SIZE
            REC_HEAD.pack_into(
                buf, off + R_QUEUE, fixed_text(queue, QUEUE_BYTES), stripe, CLAIMER_STATES.index("stopped"), 0, 0, 0.0,
                now,
            )
        ring_init: list[Any] = [0, 0, 0.0, 0.0, 0, 0, b"", *([0] * len(TOTALS))]
        for _ in RINGS:
            ring_init += [-1, 0, 0, 0.0, 0.0, *([0] * (2 * len(PRUNE_OUTCOMES)))]
        RING_BODY.pack_into(buf, RING_OFFSET + 8, *ring_init)
        HEADER.pack_into(
            buf, 0, b"\0" * 8, LAYOUT_VERSION, n, HEADER_SIZE, RING_SIZE, RECORD_SIZE, HIST_BUCKETS, size, now,
            os.getpid(), SIZE_BUCKETS,
        )
        buf[0:8] = MAGIC  # last: an attacher never sees a half-initialised header as valid
        return cls(shm, name, n, creator=True)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
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
        buf = _buf_of(shm, name)
        magic, version, n, hsize, rsize, recsize, buckets, size, _, pid, sbuckets = HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ShmLayoutError(name, f"magic {magic!r}, expected {MAGIC!r}")
        if version != LAYOUT_VERSION:
            raise ShmLayoutError(
                name, f"layout version {version}, this awa-fast reads version {LAYOUT_VERSION}: the supervisor "
                f"(pid {pid}) runs another awa-fast version; use that version's awa-fast, or restart the supervisor "
                "with this one")
        sizes = (hsize, rsize, recsize, buckets, sbuckets)
        if sizes != (HEADER_SIZE, RING_SIZE, RECORD_SIZE, HIST_BUCKETS, SIZE_BUCKETS):
            raise ShmLayoutError(name, f"section sizes {sizes} do not match layout {version}")
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

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _buffer(self) -> memoryview:
        if self._buf is None:
            raise ShmError(f"shared-memory segment {self.name!r} is closed")
        return self._buf

    # -- header, status records -------------------------------------------------
    def header(self) -> dict[str, Any]:
        """Header fields as a dict."""
        _, version, n, _, _, _, buckets, size, created, pid, sbuckets = HEADER.unpack_from(self._buffer(), 0)
        return {
            "layout_version": version,
            "claimers": n,
            "segment_size": size,
            "created_at": created,
            "supervisor_pid": pid,
            "histogram_buckets": buckets,
            "size_histogram_buckets": sbuckets,
        }

    def claimer(self, index: int) -> StatusRecord:
        """The status record of claimer ``index`` (same object for every call in this process)."""
        if not 0 <= index < self.claimers:
            raise IndexError(f"claimer index {index} out of range 0..{self.claimers - 1}")
        return self._records[index]

    # -- ring section ---------------------------------------------------------------
    def publish_rings(
        self,
        rings: Mapping[str, Mapping[str, int | float]],
        leader_pid: int,
        *,
        leader_host: str | None = None,
        leader_since: float | None = None,
        tick: float | None = None,
        role: str = "leader",
        totals: Mapping[str, int] | None = None,
    ) -> None:
        """Publish ring state (fields not given keep their values) in one seqlock write.

        ``rings`` maps each of :data:`RINGS` to any of :data:`RING_FIELDS`
        (see :func:`prune_outcome_fields`). ``totals`` (:data:`TOTALS`) and
        the rings' ``total_*`` fields are the caller's running totals: what
        the section held when this process first published here is added to
        them, so a restarted maintenance process continues the counts.
        ``leader_host`` defaults to this host, ``tick`` to now;
        ``leader_since`` None keeps the stored value.
        """
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {ROLES}")
        for ring, fields in rings.items():
            if ring not in RINGS:
                raise ValueError(f"unknown ring {ring!r}; use one of {RINGS}")
            bad = set(fields) - set(RING_FIELDS)
            if bad:
                raise ValueError(f"unknown ring fields {sorted(bad)}; use {RING_FIELDS}")
        bad = set(totals or ()) - set(TOTALS)
        if bad:
            raise ValueError(f"unknown maintenance totals {sorted(bad)}; use {TOTALS}")
        host = socket.gethostname() if leader_host is None else leader_host
        buf = self._buffer()
        nf = len(RING_FIELDS)
        with self._ring_lock:
            v = list(RING_BODY.unpack_from(buf, RING_OFFSET + 8))
            if self._totals_base is None:  # this process's first publish: continue the stored totals
                base = list(v[7:_RING_HEAD_LEN])
                for r in range(len(RINGS)):
                    start = _RING_HEAD_LEN + r * nf
                    base += [v[start + RING_FIELDS.index(f)] for f in _TOTAL_FIELDS]
                self._totals_base = base
            v[0] = leader_pid
            v[1] = host_hash(host)
            if leader_since is not None:
                v[2] = leader_since
            v[3] = time.time() if tick is None else tick
            v[4] = ROLES.index(role)
            v[6] = fixed_text(host, HOST_BYTES)
            for i, key in enumerate(TOTALS):
                if totals and key in totals:
                    v[7 + i] = self._totals_base[i] + int(totals[key])
            for r, ring in enumerate(RINGS):
                given = rings.get(ring)
                if given:
                    start = _RING_HEAD_LEN + r * nf
                    for i, key in enumerate(RING_FIELDS):
                        if key in given:
                            value = given[key]
                            if key in RING_FLOATS:
                                v[start + i] = float(value)
                            elif key.startswith("total_"):
                                b = len(TOTALS) + r * len(_TOTAL_FIELDS) + _TOTAL_FIELDS.index(key)
                                v[start + i] = self._totals_base[b] + int(value)
                            else:
                                v[start + i] = int(value)
            seq = odd_version(buf, RING_OFFSET)
            SEQ.pack_into(buf, RING_OFFSET, seq)
            RING_BODY.pack_into(buf, RING_OFFSET + 8, *v)
            SEQ.pack_into(buf, RING_OFFSET, seq + 1)

    def read_rings(self) -> RingSnapshot:
        """The ring section as a :class:`RingSnapshot`."""
        data, torn = read_consistent(self._buffer(), RING_OFFSET, RING_SIZE)
        v = RING_BODY.unpack_from(data, 8)
        nf = len(RING_FIELDS)
        rings = {}
        for r, ring in enumerate(RINGS):
            start = _RING_HEAD_LEN + r * nf
            rings[ring] = RingState(*v[start : start + nf])
        role = v[4]
        return RingSnapshot(
            leader_pid=v[0],
            leader_host=text_of(v[6]),
            leader_host_hash=v[1],
            leader_since=v[2],
            last_tick=v[3],
            role=ROLES[role] if role < len(ROLES) else f"unknown({role})",
            totals=dict(zip(TOTALS, v[7:_RING_HEAD_LEN], strict=True)),
            rings=rings,
            torn=torn,
        )

    def snapshot(self) -> dict[str, Any]:
        """The whole segment as a plain JSON-able dict (``awa-fast status --json``, ``/metrics``)."""
        header = self.header()
        return {
            "name": self.name,
            "now": time.time(),
            **header,
            "supervisor_alive": pid_alive(header["supervisor_pid"]),
            "histogram_bounds": list(TIME_EDGES),
            "size_bounds": list(SIZE_EDGES),
            "maintenance": self.read_rings().to_dict(),
            "claimers": [rec.read() for rec in self._records],
        }
