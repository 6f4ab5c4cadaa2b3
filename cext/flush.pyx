# Included by codec.pyx after snapshots.pyx (it reads Job's and ClaimSnapshot's slot offsets).
#
# flush_tally: the claimer's one pass over a completion flush (Claimer.flushed), per job:
# its key, whether and how it counts, and the latency samples. The Python twin's loop in
# _pycodec.flush_tally is the definition; this is the same loop without the bytecode. Job
# slots are read at the offsets the probe in snapshots.pyx verified (any other object, or an
# unset slot: getattr, as the twin does).

from awa_fast.jobs import AttemptClosed as _AttemptClosed
from awa_fast.outcomes import COMPLETED as _COMPLETED
from awa_fast.outcomes import Unwritten as _Unwritten

cdef object _PARKED = _Unwritten.PARKED
cdef object _STALE = _Unwritten.STALE
cdef Py_ssize_t _jo_finished_at = -1
cdef Py_ssize_t _off_created_at = -1
cdef object _NO_DEFAULT = object()  # _job_slot without a default: a missing attribute raises


cdef void _probe_flush_offsets() except *:
    global _jo_finished_at, _off_created_at
    if _job_build_ok:
        _jo_finished_at = _member_offset(Job, "finished_at", (<_TypeView*>_job_type).tp_basicsize)
    if _snap_slots_ok:
        _off_created_at = _member_offset(ClaimSnapshot, "created_at", (<_TypeView*>_snap_type).tp_basicsize)


_probe_flush_offsets()


cdef inline object _job_slot(object job, Py_ssize_t off, str name, object default):
    """``getattr(job, name, default)``: from its slot when ``job`` is exactly a Job."""
    cdef PyObject* value
    if off >= 0 and Py_TYPE(job) == _job_type:
        value = (<PyObject**>((<char*><PyObject*>job) + off))[0]
        if value is not NULL:
            return <object>value
        if default is not _NO_DEFAULT:
            return default
    if default is _NO_DEFAULT:
        return getattr(job, name)
    return getattr(job, name, default)


def flush_tally(pairs, stale, offset, committed, closed):
    """One pass over a flush's ``(job, outcome)`` pairs (see ``_pycodec.flush_tally``)."""
    cdef Py_ssize_t i, n
    cdef Py_ssize_t completed = 0
    cdef bint any_stale = bool(stale)
    cdef bint want_closed = closed is not None
    cdef double off = offset, cmt = committed, created = 0.0
    if type(pairs) is not list:
        pairs = list(pairs)
    n = PyList_GET_SIZE(pairs)
    cdef list keys = PyList_New(n)
    cdef dict other = {}
    cdef list e2e = [], pickup = [], handler = []
    last_at = None
    for i in range(n):
        if i >= PyList_GET_SIZE(pairs):
            raise RuntimeError("pairs changed size during flush_tally")
        pair = <object>PyList_GET_ITEM(pairs, i)
        job, outcome = pair
        key = _job_slot(job, _jo_key, "key", _NO_DEFAULT)
        Py_INCREF(key)
        PyList_SET_ITEM(keys, i, key)
        started = _job_slot(job, _jo_started_at, "started_at", _NO_DEFAULT)
        if started:
            finished = _job_slot(job, _jo_finished_at, "finished_at", 0.0)  # unset: not returned yet
            if finished:
                handler.append(finished - started)
        if outcome is _COMPLETED and not (any_stale and key in stale):
            what = "completed"
            completed += 1
        elif outcome is _PARKED:
            continue
        else:
            if outcome is _STALE or (any_stale and key in stale):
                what = "stale"
            else:
                what = outcome.code.closed_as
            other[what] = other.get(what, 0) + 1
        if want_closed:
            closed.append(_AttemptClosed(job.id, job.run_lease, job.kind, what, started or 0.0, committed))
        if what == "stale":
            continue
        snap = _job_slot(job, _jo_snapshot, "snapshot", _NO_DEFAULT)
        at = _snap_field(snap, _off_created_at, "created_at")
        if at != last_at:
            last_at = at
            created = at.timestamp() - off
        e2e.append(cmt - created)
        if started:
            pickup.append(started - created)
    return keys, completed, other, e2e, pickup, handler


# --------------------------------------------------------------------------
# raw_jsonb: the claim connection's binary jsonb loader (its ``load``), in one C call per value.

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer


def raw_jsonb(data):
    """``bytes(memoryview(data)[1:])``: a binary jsonb value as its JSON text (the version byte dropped)."""
    cdef Py_buffer view
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len <= 1:
            return b""
        return PyBytes_FromStringAndSize(<char*>view.buf + 1, view.len - 1)
    finally:
        PyBuffer_Release(&view)


# --------------------------------------------------------------------------
# claim_summary: a claim's receipts (claim_id -> jobs) and kinds, in one pass (the claimer's dispatch).

def claim_summary(snapshots):
    """``(Counter(s.claim_id for s in snapshots), {s.kind for s in snapshots})`` as a plain dict and a set."""
    cdef Py_ssize_t i, n, run = 0
    if type(snapshots) is not list:
        snapshots = list(snapshots)
    n = PyList_GET_SIZE(snapshots)
    cdef dict counts = {}
    cdef set kinds = set()
    last_cid = None
    last_kind = None
    for i in range(n):
        if i >= PyList_GET_SIZE(snapshots):
            raise RuntimeError("snapshots changed size during claim_summary")
        snap = <object>PyList_GET_ITEM(snapshots, i)
        cid = _snap_field(snap, _off_claim_id, "claim_id")
        kind = _snap_field(snap, _off_kind, "kind")
        if run and (cid is last_cid or cid == last_cid):
            run += 1
        else:
            if run:
                counts[last_cid] = counts.get(last_cid, 0) + run
            last_cid = cid
            run = 1
        if kind is not last_kind:
            kinds.add(kind)
            last_kind = kind
    if run:
        counts[last_cid] = counts.get(last_cid, 0) + run
    return counts, kinds
