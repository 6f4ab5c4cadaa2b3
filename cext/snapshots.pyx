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


cdef object _snapshot_from_tuple(tuple row):
    """ClaimSnapshot(*row) for a row of the right length, filling the slots."""
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(row)
    cdef PyObject* obj = PyType_GenericAlloc(_snap_type, 0)
    cdef PyObject* item
    cdef char* base = <char*>obj
    for i in range(n):
        item = PyTuple_GET_ITEM(row, i)
        Py_INCREF(<object>item)
        (<PyObject**>(base + _snap_off[i]))[0] = item
    for i in range(n, _snap_nfields):
        Py_INCREF(None)
        (<PyObject**>(base + _snap_off[i]))[0] = <PyObject*>None
    result = <object>obj
    Py_XDECREF(obj)
    return result


def decode_snapshots(rows):
    """``[ClaimSnapshot(*row) for row in rows]``: rows in ClaimSnapshot field order."""
    cdef Py_ssize_t i, n
    cdef PyObject* row
    if type(rows) is not list and type(rows) is not tuple:
        rows = list(rows)
    n = PySequence_Fast_GET_SIZE(rows)
    cdef list out = PyList_New(n)
    for i in range(n):
        if i >= PySequence_Fast_GET_SIZE(rows):  # a row's __iter__ shrank the list
            raise RuntimeError("rows changed size during decode_snapshots")
        row = PySequence_Fast_ITEMS(rows)[i]
        if (
            _snap_build_ok
            and type(<object>row) is tuple
            and _snap_nrequired <= PyTuple_GET_SIZE(<object>row) <= _snap_nfields
        ):
            snap = _snapshot_from_tuple(<tuple>row)
        else:
            snap = ClaimSnapshot(*<object>row)
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


# --------------------------------------------------------------------------
# The claim's rows as one binary COPY stream: decode_copy_snapshots.
#
# The stream is what ``COPY (SELECT <the 18 ClaimSnapshot columns> FROM claim_batch_v3(...)) TO
# STDOUT (FORMAT binary)`` sends. Each field becomes the object the claim connection's binary
# cursor gives for it (int8/int4 -> int, text -> str, jsonb -> raw JSON bytes without the version
# byte, timestamptz -> datetime in UTC, NULL -> None), and each row a ClaimSnapshot (slots filled
# directly when the layout probe agreed). Equal consecutive created_at, queue and kind values share
# one object, as a claim's rows mostly do. Same checks, order and messages as the Python twin.

from cpython.buffer cimport PyBUF_SIMPLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.datetime cimport datetime_new, import_datetime
from cpython.long cimport PyLong_FromLong, PyLong_FromLongLong
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int16_t, int32_t, uint64_t
from libc.string cimport memcmp

import datetime as _datetime

import_datetime()
_UTC = _datetime.timezone.utc

cdef enum:
    _K_I8 = 0
    _K_I4 = 1
    _K_TEXT = 2
    _K_JSONB = 3
    _K_TSTZ = 4
    _SNAP_COLUMNS = 18

cdef int[18] _SNAP_KINDS = [_K_I8, _K_I4, _K_I4, _K_I4, _K_TEXT, _K_TEXT, _K_I4, _K_JSONB, _K_JSONB,
                            _K_I4, _K_I4, _K_I8, _K_I4, _K_I8, _K_TSTZ, _K_JSONB, _K_JSONB, _K_JSONB]
cdef int64_t _TS_MIN = -63082281600000000  # 0001-01-01 00:00:00 UTC, in us from 2000-01-01
cdef int64_t _TS_MAX = 252455615999999999  # 9999-12-31 23:59:59.999999 UTC
cdef int64_t _US_PER_DAY = 86400000000


cdef inline int32_t _get_i32(const unsigned char* p) noexcept nogil:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | <uint32_t>p[3])


cdef inline int64_t _get_i64(const unsigned char* p) noexcept nogil:
    return <int64_t>((<uint64_t>_get_i32(p) << 32) | <uint32_t>_get_i32(p + 4))


cdef inline object _malformed(str what):
    return ValueError(f"malformed claim COPY stream: {what}")


cdef object _utc_datetime(int64_t micros):
    """The timestamptz ``micros`` (us from 2000-01-01 UTC, in range) as an aware datetime in UTC."""
    cdef int64_t days = micros // _US_PER_DAY
    cdef int64_t rem = micros - days * _US_PER_DAY
    if rem < 0:  # C division truncates toward zero
        days -= 1
        rem += _US_PER_DAY
    # civil date from a day count (days since 0000-03-01, proleptic Gregorian)
    cdef int64_t z = days + 10957 + 719468
    cdef int64_t era = (z if z >= 0 else z - 146096) // 146097
    cdef int64_t doe = z - era * 146097
    cdef int64_t yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    cdef int64_t doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    cdef int64_t mp = (5 * doy + 2) // 153
    cdef int day = <int>(doy - (153 * mp + 2) // 5 + 1)
    cdef int month = <int>(mp + 3 if mp < 10 else mp - 9)
    cdef int year = <int>(yoe + era * 400 + (1 if month <= 2 else 0))
    cdef int64_t secs = rem // 1000000
    return datetime_new(year, month, day, <int>(secs // 3600), <int>((secs // 60) % 60), <int>(secs % 60),
                        <int>(rem % 1000000), _UTC)


def decode_copy_snapshots(data):
    """The snapshots of a claim's binary COPY stream, and whether it ended with the backlog marker.

    The same snapshots as ``decode_snapshots`` over the claim's rows fetched by
    a binary cursor with the raw-jsonb loader, after the marker row (job_id
    NULL, last) is taken off: ``(snapshots, marker_seen)``. A stream that is not
    a complete binary COPY of the claim's 18 columns raises ``ValueError``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be a bytes-like object, not {type(data).__name__}")
    cdef Py_buffer view
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        return _decode_copy(<const unsigned char*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef tuple _decode_copy(const unsigned char* buf, Py_ssize_t end):
    cdef Py_ssize_t pos, size, row_no, col, k
    cdef bint marker
    cdef int32_t flags, ext, nfields
    cdef int kind
    cdef int64_t micros, last_ts = 0
    cdef bint have_ts = False
    cdef const unsigned char* text_at[2]
    cdef Py_ssize_t text_len[2]
    cdef list out = []
    cdef tuple row
    cdef object value, snap, last_claim_obj = None
    cdef char* base = NULL
    cdef PyObject** slot
    cdef int64_t v8, last_claim_id = 0
    cdef bint have_claim_id = False
    cdef object last_dt = None
    cdef list last_text = [None, None]
    text_at[0] = text_at[1] = NULL
    text_len[0] = text_len[1] = -1
    if end < 19 or memcmp(buf, _HEADER, 11) != 0:
        raise _malformed("no binary COPY header")
    flags = _get_i32(buf + 11)
    if flags & <int32_t>0xFFFF0000:  # bits 16-31: OIDs or a critical flag this reader does not know
        raise _malformed(f"header flags 0x{<uint32_t>flags:08x}")
    ext = _get_i32(buf + 15)
    if ext < 0 or ext > end - 19:
        raise _malformed("truncated header extension")
    pos = 19 + ext
    while True:
        if pos + 2 > end:
            raise _malformed(f"truncated at byte {pos}")
        nfields = <int16_t>((<uint16_t>buf[pos] << 8) | buf[pos + 1])
        pos += 2
        if nfields == -1:
            break
        row_no = len(out)
        if nfields != _SNAP_COLUMNS:
            raise _malformed(f"row {row_no} has {nfields} fields, expected {<int>_SNAP_COLUMNS}")
        if _snap_build_ok:  # the snapshot itself, its slots filled as the fields are read
            snap = <object>PyType_GenericAlloc(_snap_type, 0)
            Py_XDECREF(<PyObject*>snap)  # (GenericAlloc's reference; ``snap`` holds its own)
            base = <char*><PyObject*>snap
            for col in range(_SNAP_COLUMNS):
                Py_INCREF(None)
                (<PyObject**>(base + _snap_off[col]))[0] = <PyObject*>None
            row = None
        else:
            row = PyTuple_New(_SNAP_COLUMNS)
        for col in range(_SNAP_COLUMNS):
            kind = _SNAP_KINDS[col]
            if pos + 4 > end:
                raise _malformed(f"truncated at byte {pos}")
            size = _get_i32(buf + pos)
            pos += 4
            if size == -1:
                value = None
            else:
                if size < 0 or size > end - pos:
                    raise _malformed(f"row {row_no} column {col}: length {size} at byte {pos - 4}")
                if kind == _K_I4:
                    if size != 4:
                        raise _malformed(f"row {row_no} column {col}: length {size}, expected 4")
                    value = PyLong_FromLong(_get_i32(buf + pos))
                elif kind == _K_I8:
                    if size != 8:
                        raise _malformed(f"row {row_no} column {col}: length {size}, expected 8")
                    v8 = _get_i64(buf + pos)
                    if col == 13 and have_claim_id and v8 == last_claim_id:  # one receipt per claim call
                        value = last_claim_obj
                    else:
                        value = PyLong_FromLongLong(v8)
                        if col == 13:
                            last_claim_obj = value
                            last_claim_id = v8
                            have_claim_id = True
                elif kind == _K_TEXT:
                    k = col - 4  # queue, kind
                    if text_len[k] == size and memcmp(text_at[k], buf + pos, size) == 0:
                        value = last_text[k]
                    else:
                        value = PyUnicode_DecodeUTF8(<const char*>(buf + pos), size, NULL)
                        last_text[k] = value
                        text_at[k] = buf + pos
                        text_len[k] = size
                elif kind == _K_JSONB:
                    # the version byte, then the JSON text (as storage.types' raw loader)
                    value = PyBytes_FromStringAndSize(<const char*>(buf + pos + 1), size - 1) if size else b""
                else:
                    if size != 8:
                        raise _malformed(f"row {row_no} column {col}: length {size}, expected 8")
                    micros = _get_i64(buf + pos)
                    if not have_ts or micros != last_ts:
                        if micros < _TS_MIN or micros > _TS_MAX:
                            raise _malformed(
                                f"row {row_no} column {col}: timestamp {micros} is outside datetime's range")
                        last_dt = _utc_datetime(micros)
                        last_ts = micros
                        have_ts = True
                    value = last_dt
                pos += size
            if row is None:
                if value is not None:
                    slot = <PyObject**>(base + _snap_off[col])
                    Py_INCREF(value)
                    Py_XDECREF(slot[0])
                    slot[0] = <PyObject*>value
            else:
                Py_INCREF(value)
                PyTuple_SET_ITEM(row, col, value)
        if row is None:
            out.append(snap)
        else:
            out.append(ClaimSnapshot(*row))
    if pos != end:
        raise _malformed(f"{end - pos} bytes after the trailer")
    marker = len(out) > 0 and _snap_field(out[len(out) - 1], _off_job_id, "job_id") is None
    if marker:
        out.pop()
    return out, marker
