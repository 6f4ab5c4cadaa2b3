# Included by codec.pyx. Binary COPY encoders for ready_entries, done_entries
# and lease_claim_closures, written straight into the bytes object returned.

cdef object _NOT_SEEN = object()  # sentinel: no queue/kind text checked yet


def encode_ready_rows(
    ready_slot, lane_id, first_seq, kind, payloads, metadata, attempt, max_attempts
):
    """Binary COPY stream for ``ready_entries (ready_slot, lane_id, lane_seq, job_id,
    kind, args, metadata, attempt, max_attempts, lease_base)``.

    Row ``i`` has ``lane_seq = first_seq + i`` and ``job_id = lane_id << 40 | lane_seq``.
    """
    cdef int64_t rs, lid, seq, att, max_att, base
    cdef Py_ssize_t i, n, size, klen, mlen = -1, total
    cdef const char* kdata
    cdef const char* mdata = NULL
    cdef PyObject** items
    cdef PyObject* payload
    cdef char* p

    if type(payloads) is not list and type(payloads) is not tuple:
        payloads = list(payloads)
    n = PySequence_Fast_GET_SIZE(payloads)
    rs = _int_arg(ready_slot, "ready_slot", -1, INT2)
    lid = _int_arg(lane_id, "lane_id", -1, INT4)
    if lid < 0:
        raise ValueError(f"lane_id={lid} must be >= 0")
    if lid >= _LANE_ID_LIMIT:
        raise OverflowError(
            f"lane_id={lid} does not fit job_id = lane_id << 40 | lane_seq (lane_id < 2**23)"
        )
    seq = _int_arg(first_seq, "first_seq", -1, INT8)
    if seq < 0:
        raise ValueError(f"first_seq={seq} must be >= 0")
    if seq > _LANE_SEQ_LIMIT - n:
        raise OverflowError(
            f"lane_seq up to {(<object>seq) + n - 1} does not fit job_id = lane_id << 40 | lane_seq "
            "(lane_seq < 2**40)"
        )
    kdata = _text_arg(kind, "kind", -1, &klen)
    if metadata is not None:
        if not PyBytes_Check(metadata):
            raise TypeError(f"metadata must be bytes or None, not {type(metadata).__name__}")
        mlen = PyBytes_GET_SIZE(metadata)
        if mlen >= _FIELD_MAX:
            raise OverflowError(f"metadata of {mlen} bytes does not fit one COPY field")
        mdata = PyBytes_AS_STRING(metadata)
    att = _int_arg(attempt, "attempt", -1, INT2)
    max_att = _int_arg(max_attempts, "max_attempts", -1, INT2)

    if PySequence_Fast_GET_SIZE(payloads) != n:  # an __index__ above changed the list
        raise RuntimeError("payloads changed size during encode_ready_rows")
    # size exactly, checking every payload first: nothing is written before all are valid
    # fixed per row: count 2, ready_slot 6, lane_id 8, lane_seq 12, job_id 12, kind 4,
    # args 4+1, metadata 4, attempt 6, max_attempts 6, lease_base 8
    total = HEADER_LEN + TRAILER_LEN + n * (73 + klen + (mlen + 1 if mlen >= 0 else 0))
    items = PySequence_Fast_ITEMS(payloads)
    for i in range(n):
        payload = items[i]
        if not PyBytes_Check(<object>payload):
            raise TypeError(f"payloads[{i}] must be bytes, not {type(<object>payload).__name__}")
        size = PyBytes_GET_SIZE(<object>payload)
        if size >= _FIELD_MAX:
            raise OverflowError(f"payloads[{i}] of {size} bytes does not fit one COPY field")
        total += size

    out = <bytes>_bytes_new(NULL, total)
    Py_XDECREF(<PyObject*>out)  # _bytes_new gave a new reference; `out` holds its own
    p = PyBytes_AS_STRING(out)
    memcpy(p, _HEADER, HEADER_LEN)
    p += HEADER_LEN
    base = lid << 40
    for i in range(n):
        payload = items[i]
        size = PyBytes_GET_SIZE(<object>payload)
        p = put_u16(p, 10)
        p = field_i16(p, rs)
        p = field_i32(p, lid)
        p = field_i64(p, seq)
        p = field_i64(p, base | seq)
        p = put_u32(p, <uint32_t>klen)
        memcpy(p, kdata, klen)
        p += klen
        p = put_u32(p, <uint32_t>(size + 1))
        p[0] = 1  # jsonb binary format version
        memcpy(p + 1, PyBytes_AS_STRING(<object>payload), size)
        p += size + 1
        if mdata is NULL:
            p = put_u32(p, 0xFFFFFFFF)
        else:
            p = put_u32(p, <uint32_t>(mlen + 1))
            p[0] = 1
            memcpy(p + 1, mdata, mlen)
            p += mlen + 1
        p = field_i16(p, att)
        p = field_i16(p, max_att)
        p = field_i32(p, 0)
        seq += 1
    put_u16(p, 0xFFFF)
    return out


def encode_done_rows(snapshots):
    """Binary COPY stream for ``done_entries (ready_slot, job_id, lane_id, lane_seq,
    run_lease, attempt, state, queue, kind)``, state 1 (completed) on every row."""
    cdef Py_ssize_t i, n, qlen = 0, klen = 0
    cdef const char* qdata = NULL
    cdef const char* kdata = NULL
    cdef int64_t rs, jid, lid, seq, lease, att
    cdef char* p
    cdef Writer w
    cdef object last_queue = _NOT_SEEN, last_kind = _NOT_SEEN
    if type(snapshots) is not list and type(snapshots) is not tuple:
        snapshots = list(snapshots)
    n = PySequence_Fast_GET_SIZE(snapshots)
    # fixed per row: count 2, ready_slot 6, job_id 12, lane_id 8, lane_seq 12, run_lease 8,
    # attempt 6, state 6, queue 4, kind 4 = 68; guess 40 bytes of queue + kind
    w.cap = HEADER_LEN + TRAILER_LEN + n * (68 + 40)
    w.buf = _bytes_new(NULL, w.cap)
    w.len = 0
    try:
        p = _writer_reserve(&w, HEADER_LEN)
        memcpy(p, _HEADER, HEADER_LEN)
        w.len += HEADER_LEN
        for i in range(n):
            if i >= PySequence_Fast_GET_SIZE(snapshots):  # an attribute getter shrank the list
                raise RuntimeError("snapshots changed size during encode_done_rows")
            snap = <object>PySequence_Fast_ITEMS(snapshots)[i]
            # read every field first (in column order), then check them in that order
            o_rs = _snap_field(snap, _off_ready_slot, "ready_slot")
            o_jid = _snap_field(snap, _off_job_id, "job_id")
            o_lid = _snap_field(snap, _off_lane_id, "lane_id")
            o_seq = _snap_field(snap, _off_lane_seq, "lane_seq")
            o_lease = _snap_field(snap, _off_run_lease, "run_lease")
            o_att = _snap_field(snap, _off_attempt, "attempt")
            o_queue = _snap_field(snap, _off_queue, "queue")
            o_kind = _snap_field(snap, _off_kind, "kind")
            rs = _int_arg(o_rs, "ready_slot", i, INT2)
            jid = _int_arg(o_jid, "job_id", i, INT8)
            lid = _int_arg(o_lid, "lane_id", i, INT4)
            seq = _int_arg(o_seq, "lane_seq", i, INT8)
            lease = _int_arg(o_lease, "run_lease", i, INT4)
            att = _int_arg(o_att, "attempt", i, INT2)
            # most rows share their queue and kind objects: check each object once
            if o_queue is not last_queue:
                qdata = _text_arg(o_queue, "queue", i, &qlen)
                last_queue = o_queue
            if o_kind is not last_kind:
                kdata = _text_arg(o_kind, "kind", i, &klen)
                last_kind = o_kind
            p = _writer_reserve(&w, 68 + qlen + klen)
            p = put_u16(p, 9)
            p = field_i16(p, rs)
            p = field_i64(p, jid)
            p = field_i32(p, lid)
            p = field_i64(p, seq)
            p = field_i32(p, lease)
            p = field_i16(p, att)
            p = field_i16(p, _STATE_COMPLETED)
            p = put_u32(p, <uint32_t>qlen)
            memcpy(p, qdata, qlen)
            p = put_u32(p + qlen, <uint32_t>klen)
            memcpy(p, kdata, klen)
            w.len += 68 + qlen + klen
        p = _writer_reserve(&w, TRAILER_LEN)
        put_u16(p, 0xFFFF)
        w.len += TRAILER_LEN
        return _writer_finish(&w)
    finally:
        Py_XDECREF(w.buf)


def encode_closure_rows(snapshots, outcome):
    """Binary COPY stream for ``lease_claim_closures (claim_slot, claim_id, job_id,
    run_lease, outcome)``, the same ``outcome`` on every row."""
    cdef Py_ssize_t i, n
    cdef int64_t out_code, cs, cid, jid, lease
    cdef char* p
    out_code = _int_arg(outcome, "outcome", -1, INT2)
    if type(snapshots) is not list and type(snapshots) is not tuple:
        snapshots = list(snapshots)
    n = PySequence_Fast_GET_SIZE(snapshots)
    # per row: count 2, claim_slot 6, claim_id 12, job_id 12, run_lease 8, outcome 6 = 46
    out = <bytes>_bytes_new(NULL, HEADER_LEN + TRAILER_LEN + n * 46)
    Py_XDECREF(<PyObject*>out)
    p = PyBytes_AS_STRING(out)
    memcpy(p, _HEADER, HEADER_LEN)
    p += HEADER_LEN
    for i in range(n):
        if i >= PySequence_Fast_GET_SIZE(snapshots):
            raise RuntimeError("snapshots changed size during encode_closure_rows")
        snap = <object>PySequence_Fast_ITEMS(snapshots)[i]
        o_cs = _snap_field(snap, _off_claim_slot, "claim_slot")
        o_cid = _snap_field(snap, _off_claim_id, "claim_id")
        o_jid = _snap_field(snap, _off_job_id, "job_id")
        o_lease = _snap_field(snap, _off_run_lease, "run_lease")
        cs = _int_arg(o_cs, "claim_slot", i, INT2)
        cid = _int_arg(o_cid, "claim_id", i, INT8)
        jid = _int_arg(o_jid, "job_id", i, INT8)
        lease = _int_arg(o_lease, "run_lease", i, INT4)
        p = put_u16(p, 5)
        p = field_i16(p, cs)
        p = field_i64(p, cid)
        p = field_i64(p, jid)
        p = field_i32(p, lease)
        p = field_i16(p, out_code)
    put_u16(p, 0xFFFF)
    return out
