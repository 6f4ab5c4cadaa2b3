# Included by codec.pyx. ClaimSnapshot slot access, decode_snapshots, and Job construction (new_jobs).
#
# ClaimSnapshot is a msgspec Struct (frozen, gc=False): every field is an
# object slot at a fixed offset, described by a member descriptor on the
# class. At import we read those offsets and check the class is a plain
# slotted, non-GC, dict-less type allocated by PyType_GenericAlloc and freed by
# PyObject_Free, not abstract, with no __post_init__, no keyword-only fields and
# None defaults: then msgspec's own constructor does exactly what we do. Then:
#   * the encoders read fields of exact ClaimSnapshot instances from their
#     slots instead of through getattr (any other object: getattr);
#   * decode_snapshots allocates the struct and stores the row's items in the
#     slots, as ClaimSnapshot(*row) does, without the call machinery.
# If any check fails, both fall back to the generic path (getattr / calling
# the class): slower, never wrong. ``_fast_snapshots`` says which is live.

cdef PyTypeObject* _snap_type = <PyTypeObject*>ClaimSnapshot
cdef Py_ssize_t _snap_nfields = 0      # fields, in declaration order
cdef Py_ssize_t _snap_nrequired = 0    # fields without a default
cdef Py_ssize_t[64] _snap_off          # slot offset of each field
cdef bint _snap_slots_ok = False       # offsets usable for reading
cdef bint _snap_build_ok = False       # decode may fill slots directly

# slot offsets of the fields the encoders read (-1: use getattr)
cdef Py_ssize_t _off_ready_slot = -1, _off_job_id = -1, _off_lane_id = -1, _off_lane_seq = -1
cdef Py_ssize_t _off_run_lease = -1, _off_attempt = -1, _off_queue = -1, _off_kind = -1
cdef Py_ssize_t _off_claim_slot = -1, _off_claim_id = -1


cdef Py_ssize_t _member_offset(object cls, str name, Py_ssize_t basicsize):
    """Offset of an object slot defined on ``cls`` itself, or -1."""
    descr = cls.__dict__.get(name)
    if descr is None or Py_TYPE(descr) != &PyMemberDescr_Type:
        return -1
    cdef PyMemberDef* member = (<PyMemberDescrObject*><PyObject*>descr).d_member
    if member.type != MEMBER_T_OBJECT_EX:
        return -1
    if member.offset < <Py_ssize_t>sizeof(PyObject) or member.offset > basicsize - <Py_ssize_t>sizeof(PyObject*):
        return -1
    if member.offset % <Py_ssize_t>sizeof(PyObject*):
        return -1
    return member.offset


cdef void _probe_snapshot_layout() except *:
    global _snap_nfields, _snap_nrequired, _snap_slots_ok, _snap_build_ok
    global _off_ready_slot, _off_job_id, _off_lane_id, _off_lane_seq, _off_run_lease
    global _off_attempt, _off_queue, _off_kind, _off_claim_slot, _off_claim_id
    cdef _TypeView* tp = <_TypeView*>_snap_type
    cdef Py_ssize_t off, i
    cls = ClaimSnapshot
    try:
        fields = cls.__struct_fields__
        defaults = cls.__struct_defaults__
    except AttributeError:
        return
    if type(fields) is not tuple or type(defaults) is not tuple:
        return
    if not 0 < len(fields) <= 64 or len(defaults) > len(fields):
        return
    if tp.tp_itemsize != 0 or tp.tp_dictoffset != 0 or tp.tp_weaklistoffset != 0:
        return
    offsets = {}
    for i, name in enumerate(fields):
        off = _member_offset(cls, name, tp.tp_basicsize)
        if off < 0:
            return
        _snap_off[i] = off
        offsets[name] = off
    if len(set(offsets.values())) != len(fields):
        return
    _snap_nfields = len(fields)
    _snap_nrequired = len(fields) - len(defaults)
    _off_ready_slot = offsets.get("ready_slot", -1)
    _off_job_id = offsets.get("job_id", -1)
    _off_lane_id = offsets.get("lane_id", -1)
    _off_lane_seq = offsets.get("lane_seq", -1)
    _off_run_lease = offsets.get("run_lease", -1)
    _off_attempt = offsets.get("attempt", -1)
    _off_queue = offsets.get("queue", -1)
    _off_kind = offsets.get("kind", -1)
    _off_claim_slot = offsets.get("claim_slot", -1)
    _off_claim_id = offsets.get("claim_id", -1)
    _snap_slots_ok = True
    _snap_build_ok = (
        tp.tp_basicsize == <Py_ssize_t>sizeof(PyObject) + _snap_nfields * <Py_ssize_t>sizeof(PyObject*)
        and not (tp.tp_flags & Py_TPFLAGS_HAVE_GC)
        and not (tp.tp_flags & ((1 << 3) | (1 << 4)))  # managed dict / weakref (3.11+)
        and tp.tp_alloc == GENERIC_ALLOC_ADDR
        and tp.tp_free == OBJECT_FREE_ADDR
        and not (tp.tp_flags & (1 << 20))  # Py_TPFLAGS_IS_ABSTRACT
        and not hasattr(cls, "__post_init__")
        and all(d is None for d in defaults)
        and _all_positional(cls, fields)
    )


cdef bint _all_positional(object cls, tuple fields) except -1:
    """Every field can be passed by position (no kw_only fields)."""
    import inspect

    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return False
    return tuple(p.name for p in params) == fields and all(
        p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params
    )


_probe_snapshot_layout()
_fast_snapshots = bool(_snap_build_ok)
_fast_snapshot_fields = bool(_snap_slots_ok)


cdef inline object _snap_field(object snap, Py_ssize_t off, str name):
    """``snap.<name>``: from its slot when ``snap`` is exactly a ClaimSnapshot."""
    cdef PyObject* value
    if off >= 0 and Py_TYPE(snap) == _snap_type:
        value = (<PyObject**>((<char*><PyObject*>snap) + off))[0]
        if value is not NULL:
            return <object>value
    return getattr(snap, name)


# the fields claim_batch_v4 sends once per receipt (awa_fast.jobs.RECEIPT_FIELDS), by position
from awa_fast.jobs import RECEIPT_FIELDS as _RECEIPT_FIELDS

_RECEIPT_AT = tuple(ClaimSnapshot.__struct_fields__.index(name) for name in _RECEIPT_FIELDS)
cdef Py_ssize_t _queue_at = _RECEIPT_AT[0]
cdef Py_ssize_t _n_receipt = len(_RECEIPT_AT)
cdef Py_ssize_t[16] _receipt_at
if _n_receipt > 16:
    raise ImportError(f"{_n_receipt} per-receipt fields: the codec holds at most 16 (rebuild with a larger array)")
for _i, _at in enumerate(_RECEIPT_AT):
    _receipt_at[_i] = _at


cdef object _snapshot_from_tuple(tuple row, object carry):
    """ClaimSnapshot(*row) for a row of the right length, filling the slots.

    ``carry`` (an exact ClaimSnapshot, or None) gives the six per-receipt
    fields in place of the row's.
    """
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(row)
    cdef PyObject* obj = PyType_GenericAlloc(_snap_type, 0)
    cdef PyObject* item
    cdef PyObject** slot
    cdef char* base = <char*>obj
    cdef char* src
    for i in range(n):
        item = PyTuple_GET_ITEM(row, i)
        Py_INCREF(<object>item)
        (<PyObject**>(base + _snap_off[i]))[0] = item
    for i in range(n, _snap_nfields):
        Py_INCREF(None)
        (<PyObject**>(base + _snap_off[i]))[0] = <PyObject*>None
    if carry is not None:
        src = <char*><PyObject*>carry
        for i in range(_n_receipt):
            slot = <PyObject**>(base + _snap_off[_receipt_at[i]])
            item = (<PyObject**>(src + _snap_off[_receipt_at[i]]))[0]
            Py_INCREF(<object>item)
            Py_XDECREF(slot[0])
            slot[0] = item
    result = <object>obj
    Py_XDECREF(obj)
    return result


cdef object _carried(object row, object last):
    """``row`` as a list with the per-receipt fields of snapshot ``last`` (the generic path)."""
    filled = list(row)
    for i in range(_n_receipt):
        filled[_receipt_at[i]] = getattr(last, _RECEIPT_FIELDS[i])
    return filled


def decode_snapshots(rows):
    """``[ClaimSnapshot(*row) for row in rows]``: rows in ClaimSnapshot field order.

    A row whose queue is None takes the six per-receipt fields
    (``_RECEIPT_FIELDS``) from the snapshot before it (claim_batch_v4 sends
    them on a receipt's first row only); a full row is taken as it is. A row
    too short to be a snapshot is never carried: ``ClaimSnapshot(*row)``
    refuses it (TypeError).
    """
    cdef Py_ssize_t i, n, size
    cdef bint short
    if type(rows) is not list and type(rows) is not tuple:
        rows = list(rows)
    n = PySequence_Fast_GET_SIZE(rows)
    cdef list out = PyList_New(n)
    snap = None
    for i in range(n):
        if i >= PySequence_Fast_GET_SIZE(rows):  # a row's __iter__ or __getitem__ shrank the list
            raise RuntimeError("rows changed size during decode_snapshots")
        # a strong reference: indexing a row that is not exactly a tuple runs Python code,
        # which may drop the list's own reference to it
        row = <object>PySequence_Fast_ITEMS(rows)[i]
        size = 0
        if type(row) is tuple:
            size = PyTuple_GET_SIZE(row)
            short = size >= _snap_nrequired and PyTuple_GET_ITEM(row, _queue_at) == <PyObject*>None
        else:
            short = len(row) >= _snap_nrequired and row[_queue_at] is None
        if short and snap is None:  # (out's unfilled items are NULL, which freeing a list allows)
            raise ValueError("a claim row without its receipt's columns came first; "
                             "the claim function and the decoder disagree (run `awa-fast migrate`)")
        if (
            _snap_build_ok
            and type(row) is tuple
            and _snap_nrequired <= size <= _snap_nfields
            and (not short or Py_TYPE(snap) == _snap_type)
        ):
            snap = _snapshot_from_tuple(<tuple>row, snap if short else None)
        elif short:
            snap = ClaimSnapshot(*_carried(row, snap))
        else:
            snap = ClaimSnapshot(*row)
        Py_INCREF(snap)
        PyList_SET_ITEM(out, i, snap)
    return out


# --------------------------------------------------------------------------
# Job construction (the claimer's dispatch): Job(snapshot, args_type, runtime).
#
# Job is a plain __slots__ class (GC-tracked, no __dict__, allocated by
# PyType_GenericAlloc) whose __init__ only stores into its slots. At import we
# read the slot offsets, build one Job both ways from a probe snapshot and
# compare every slot; only when they agree does new_jobs fill the slots
# itself. Otherwise (a changed Job, another allocator) it calls Job(...), as
# the Python twin always does: slower, never different.

from awa_fast.jobs import _UNSET as _JOB_UNSET
from awa_fast.jobs import Job

cdef PyTypeObject* _job_type = <PyTypeObject*>Job
cdef Py_ssize_t _jo_snapshot = -1, _jo_key = -1, _jo_args_type = -1, _jo_args = -1, _jo_progress = -1
cdef Py_ssize_t _jo_cancelled = -1, _jo_runtime = -1, _jo_callback_token = -1, _jo_lease_backed = -1
cdef Py_ssize_t _jo_started_at = -1
cdef bint _job_build_ok = False
cdef object _job_unset = _JOB_UNSET


cdef inline void _put_slot(char* base, Py_ssize_t off, object value):
    Py_INCREF(value)
    (<PyObject**>(base + off))[0] = <PyObject*>value


cdef object _job_filled(object snap, object args_type, object runtime):
    """Job(snap, args_type, runtime) by filling its slots (only once the probe agreed)."""
    key = (_snap_field(snap, _off_job_id, "job_id"), _snap_field(snap, _off_run_lease, "run_lease"))
    cdef PyObject* obj = PyType_GenericAlloc(_job_type, 0)
    cdef char* base = <char*>obj
    _put_slot(base, _jo_snapshot, snap)
    _put_slot(base, _jo_key, key)
    _put_slot(base, _jo_args_type, args_type)
    _put_slot(base, _jo_args, _job_unset)
    _put_slot(base, _jo_progress, None)
    _put_slot(base, _jo_cancelled, False)
    _put_slot(base, _jo_runtime, runtime)
    _put_slot(base, _jo_callback_token, None)
    _put_slot(base, _jo_lease_backed, False)
    _put_slot(base, _jo_started_at, 0.0)
    result = <object>obj
    Py_XDECREF(obj)
    return result


cdef void _probe_job_layout() except *:
    global _jo_snapshot, _jo_key, _jo_args_type, _jo_args, _jo_progress, _jo_cancelled, _jo_runtime
    global _jo_callback_token, _jo_lease_backed, _jo_started_at, _job_build_ok
    cdef _TypeView* tp = <_TypeView*>_job_type
    cls = Job
    if not _snap_slots_ok or tp.tp_itemsize != 0 or tp.tp_dictoffset != 0 or tp.tp_weaklistoffset != 0:
        return
    if tp.tp_alloc != GENERIC_ALLOC_ADDR or (tp.tp_flags & ((1 << 3) | (1 << 4))):
        return
    slots = cls.__dict__.get("__slots__")
    if type(slots) is not tuple:
        return
    offsets = {}
    for name in slots:
        off = _member_offset(cls, name, tp.tp_basicsize)
        if off < 0:
            return
        offsets[name] = off
    try:
        _jo_snapshot, _jo_key, _jo_args_type, _jo_args = (
            offsets["snapshot"], offsets["key"], offsets["_args_type"], offsets["_args"])
        _jo_progress, _jo_cancelled, _jo_runtime = offsets["_progress"], offsets["_cancelled"], offsets["_runtime"]
        _jo_callback_token, _jo_lease_backed, _jo_started_at = (
            offsets["callback_token"], offsets["lease_backed"], offsets["started_at"])
    except KeyError:
        return
    import datetime
    probe = ClaimSnapshot(7, 3, 1, 25, "q", "k", 2, b"{}", None, 0, 1, 9, 0, 11,
                          datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc))
    runtime = object()
    made = cls(probe, int, runtime)
    filled = _job_filled(probe, int, runtime)
    for name in slots:
        has_made = hasattr(made, name)
        if has_made != hasattr(filled, name):
            return
        if has_made:
            a, b = getattr(made, name), getattr(filled, name)
            if type(a) is not type(b) or not (a is b or a == b):
                return
    _job_build_ok = True


_probe_job_layout()
_fast_jobs = bool(_job_build_ok)


def new_jobs(snapshots, args_types, runtime):
    """``[Job(s, args_types.get(s.kind), runtime) for s in snapshots]`` (``args_types``: a dict)."""
    cdef Py_ssize_t i, n
    if type(snapshots) is not list:
        snapshots = list(snapshots)
    n = PyList_GET_SIZE(snapshots)
    cdef list out = PyList_New(n)
    get = args_types.get
    for i in range(n):
        if i >= PyList_GET_SIZE(snapshots):
            raise RuntimeError("snapshots changed size during new_jobs")
        snap = <object>PyList_GET_ITEM(snapshots, i)
        args_type = get(_snap_field(snap, _off_kind, "kind"))
        if _job_build_ok and Py_TYPE(snap) == _snap_type:
            job = _job_filled(snap, args_type, runtime)
        else:
            job = Job(snap, args_type, runtime)
        Py_INCREF(job)
        PyList_SET_ITEM(out, i, job)
    return out
