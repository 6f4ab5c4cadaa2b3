"""Pure-Python twin of the compiled codec ``awa_fast._codec`` (``cext/codec.pyx``).

Function for function, the two modules take the same arguments, raise the same
exceptions (same type, same message) and return byte-identical output; the
unit tests compare them on generated inputs. :mod:`awa_fast._impl` picks one.

The encoders return complete PostgreSQL binary ``COPY`` streams: the 11-byte
signature, int32 flags 0, int32 header-extension length 0, then per row an
int16 field count and each field as int32 length + bytes (NULL: length -1),
all big-endian, then the int16 trailer -1.

Decisions shared with the C module (keep the two in step):

* ``check_payload`` accepts the exact types ``None``, ``bool``, ``int``,
  ``float``, ``str``, ``list``, ``tuple`` and ``dict`` only. Subclasses
  (``IntEnum``, ``StrEnum``, named tuples, ``OrderedDict``...) are rejected:
  orjson and msgspec encode them differently from each other (and a subclass
  can change what it encodes to), so convert them (``.value``, ``dict(...)``).
* ints must fit signed 64 bits. jsonb itself stores numeric, but orjson
  refuses larger ints and every reader (``(args->>'n')::bigint``, serde's
  i64) can then read the value back exactly.
* ``max_depth`` counts containers (the top-level dict is depth 1) and must be
  in ``0..MAX_DEPTH_LIMIT``.
* Integer columns accept anything with ``__index__`` (bool included); a value
  outside the column type raises ``OverflowError``, a negative ``lane_id`` or
  ``first_seq`` raises ``ValueError``. ``job_id = lane_id << 40 | lane_seq``,
  so ``lane_id < 2**23`` and every ``lane_seq < 2**40`` (else ``OverflowError``).
* Text columns take ``str`` (subclasses are read as plain str), encoded UTF-8;
  a lone surrogate raises ``UnicodeEncodeError``, a NUL ``ValueError``.
* jsonb columns take ``bytes`` holding JSON text (not re-validated here:
  PostgreSQL rejects invalid JSON and the whole COPY with it).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from math import isfinite
from operator import attrgetter
from operator import index as _index
from typing import Any

from awa_fast.errors import PayloadError
from awa_fast.jobs import RECEIPT_FIELDS as _RECEIPT_FIELDS
from awa_fast.jobs import AttemptClosed, ClaimSnapshot, Job
from awa_fast.outcomes import COMPLETED, Unwritten

__all__ = [
    "COPY_HEADER",
    "COPY_TRAILER",
    "MAX_DEPTH_LIMIT",
    "check_payload",
    "claim_summary",
    "decode_snapshots",
    "dump_payloads",
    "encode_closure_rows",
    "encode_done_rows",
    "encode_ready_rows",
    "flush_tally",
    "new_jobs",
    "raw_jsonb",
]

COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
COPY_TRAILER = b"\xff\xff"
MAX_DEPTH_LIMIT = 512

_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1
_LANE_ID_LIMIT = 2**23  # lane_id << 40 must stay inside int8
_LANE_SEQ_LIMIT = 2**40
_FIELD_MAX = 2**31 - 1  # int32 field length
_STATE_COMPLETED = 1

_RANGES = {
    "int2": (-(2**15), 2**15 - 1),
    "int4": (-(2**31), 2**31 - 1),
    "int8": (_I64_MIN, _I64_MAX),
}

# --------------------------------------------------------------------------
# error messages (cold paths; the C module builds the very same strings)

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _format_path(parts: Iterable[int | str]) -> str:
    out = ["$"]
    for part in parts:
        if type(part) is int:
            out.append(f"[{part}]")
        elif _IDENT.fullmatch(part):  # type: ignore[arg-type]
            out.append("." + part)  # type: ignore[operator]
        else:
            out.append("[" + json.dumps(part) + "]")
    return "".join(out)


def _show_int(value: int) -> str:
    return str(value) if value.bit_length() <= 128 else f"<{value.bit_length()}-bit int>"


def _int_type_error(what: str, value: object) -> TypeError:
    return TypeError(f"{what} must be an int, not {type(value).__name__}")


def _overflow(what: str, value: int, typ: str) -> OverflowError:
    lo, hi = _RANGES[typ]
    return OverflowError(f"{what}={_show_int(value)} does not fit {typ} ({lo}..{hi})")


def _text_type_error(what: str, value: object) -> TypeError:
    return TypeError(f"{what} must be a str, not {type(value).__name__}")


def _text_nul_error(what: str) -> ValueError:
    return ValueError(f"{what} contains NUL (\\x00), which PostgreSQL text rejects")


def _str_problem(s: str, what: str) -> str | None:
    """Message for the first NUL or lone surrogate in ``s``, or None."""
    if s.isascii():
        return None if "\x00" not in s else f"{what} contains NUL (\\u0000), which PostgreSQL jsonb rejects"
    nul = s.find("\x00")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        if nul < 0 or exc.start < nul:
            return f"{what} contains lone surrogate U+{ord(s[exc.start]):04X}, which is not valid UTF-8"
    if nul >= 0:
        return f"{what} contains NUL (\\u0000), which PostgreSQL jsonb rejects"
    return None


# --------------------------------------------------------------------------
# check_payload

_INT_MSG = "int outside the signed 64-bit range -2**63..2**63-1"
_TYPES_MSG = "allowed: None, bool, int, float, str, list, tuple, dict (exact types, not subclasses)"


def _walk(obj: object, depth: int, max_depth: int, trail: list[Any]) -> bool:
    """True (with ``trail`` = [message, innermost part, ..., outermost part]) if obj is bad."""
    t = type(obj)
    if t is str:
        msg = _str_problem(obj, "str")  # type: ignore[arg-type]
        if msg is not None:
            trail.append(msg)
            return True
        return False
    if t is int:
        if _I64_MIN <= obj <= _I64_MAX:  # type: ignore[operator]
            return False
        trail.append(_INT_MSG)
        return True
    if t is dict:
        if depth >= max_depth:
            trail.append(f"nesting deeper than max_depth={max_depth}")
            return True
        depth += 1
        for key, value in obj.items():  # type: ignore[attr-defined]
            if type(key) is not str:
                trail.append(
                    f"dict key of type {type(key).__name__} is not a str (JSON object keys must be plain str)"
                )
                return True
            msg = _str_problem(key, "dict key")
            if msg is not None:
                trail.append(msg)
                trail.append(key)
                return True
            if _walk(value, depth, max_depth, trail):
                trail.append(key)
                return True
        return False
    if t is float:
        if isfinite(obj):  # type: ignore[arg-type]
            return False
        trail.append(f"float {float.__repr__(obj)} is not valid JSON (NaN and infinities are not allowed)")
        return True
    if t is list or t is tuple:
        if depth >= max_depth:
            trail.append(f"nesting deeper than max_depth={max_depth}")
            return True
        depth += 1
        for i, value in enumerate(obj):  # type: ignore[arg-type]
            if _walk(value, depth, max_depth, trail):
                trail.append(i)
                return True
        return False
    if obj is None or t is bool:
        return False
    trail.append(f"unsupported type {t.__name__}; {_TYPES_MSG}")
    return True


def check_payload(obj: object, max_depth: int = 32) -> None:
    """Raise :class:`~awa_fast.errors.PayloadError` if ``obj`` cannot be stored as jsonb.

    See the module docstring for exactly what is accepted.
    """
    if type(max_depth) is not int:
        max_depth = _index(max_depth)
    if not 0 <= max_depth <= MAX_DEPTH_LIMIT:
        raise ValueError(f"max_depth={max_depth} must be in 0..{MAX_DEPTH_LIMIT}")
    trail: list[Any] = []
    if _walk(obj, 0, max_depth, trail):
        raise PayloadError(trail[0], _format_path(reversed(trail[1:])))


def dump_payloads(
    objs: list[Any], start: int, out: list[bytes], max_depth: int, limit: int, dumps: Callable[[Any], Any]
) -> int:
    """Check and encode ``objs[start:]`` into ``out`` while they take the fast path.

    For each item from ``start`` on, in order: if it is exactly a ``dict`` or
    a ``list``, passes :func:`check_payload` with ``max_depth``, and
    ``dumps(item)`` returns exactly ``bytes`` of at most ``limit`` bytes,
    those bytes are appended to ``out``. Returns the index of the first item
    that did not (nothing is raised for it, not even what ``dumps`` raised:
    the caller gives that item its full treatment and error, then calls again
    from the next index), or ``len(objs)`` when all did. A bulk enqueue thus
    runs one C loop instead of a Python call per payload.
    """
    if type(objs) is not list:
        raise TypeError(f"objs must be a list, not {type(objs).__name__}")
    if type(out) is not list:
        raise TypeError(f"out must be a list, not {type(out).__name__}")
    if type(max_depth) is not int:
        max_depth = _index(max_depth)
    if not 0 <= max_depth <= MAX_DEPTH_LIMIT:
        raise ValueError(f"max_depth={max_depth} must be in 0..{MAX_DEPTH_LIMIT}")
    i = _index(start)
    limit = _index(limit)
    if i < 0:
        raise ValueError(f"start={i} must be >= 0")
    # the size is read at every step: dumps is Python code and may change the list
    while i < len(objs):
        obj = objs[i]
        t = type(obj)
        if t is not dict and t is not list:
            return i
        if _walk(obj, 0, max_depth, []):
            return i
        try:
            data = dumps(obj)
        except Exception:
            return i
        if type(data) is not bytes or len(data) > limit:
            return i
        out.append(data)
        i += 1
    return i


# --------------------------------------------------------------------------
# integer / text fields


def _as_int(value: object, what: str, typ: str) -> int:
    if type(value) is not int:
        if not hasattr(type(value), "__index__"):
            raise _int_type_error(what, value)
        value = _index(value)  # type: ignore[arg-type]
    lo, hi = _RANGES[typ]
    if not lo <= value <= hi:
        raise _overflow(what, value, typ)
    return value


def _text_bytes(value: object, what: str) -> bytes:
    if type(value) is not str:
        if not isinstance(value, str):
            raise _text_type_error(what, value)
        value = str.__str__(value)
    data = value.encode()
    if b"\x00" in data:
        raise _text_nul_error(what)
    return data


def _text_field(value: object, what: str) -> bytes:
    data = _text_bytes(value, what)
    return _I32.pack(len(data)) + data


_I32 = struct.Struct(">i")
_NULL_FIELD = b"\xff\xff\xff\xff"


# --------------------------------------------------------------------------
# ready_entries


def encode_ready_rows(
    ready_slot: int,
    lane_id: int,
    first_seq: int,
    kind: str,
    payloads: Sequence[bytes],
    metadata: bytes | None,
    attempt: int,
    max_attempts: int,
) -> bytes:
    """Binary COPY stream for ``ready_entries (ready_slot, lane_id, lane_seq, job_id,
    kind, args, metadata, attempt, max_attempts, lease_base)``.

    Row ``i`` has ``lane_seq = first_seq + i`` and ``job_id = lane_id << 40 | lane_seq``.
    """
    if type(payloads) is not list and type(payloads) is not tuple:
        payloads = list(payloads)
    n = len(payloads)
    ready_slot = _as_int(ready_slot, "ready_slot", "int2")
    lane_id = _as_int(lane_id, "lane_id", "int4")
    if lane_id < 0:
        raise ValueError(f"lane_id={lane_id} must be >= 0")
    if lane_id >= _LANE_ID_LIMIT:
        raise OverflowError(
            f"lane_id={lane_id} does not fit job_id = lane_id << 40 | lane_seq (lane_id < 2**23)"
        )
    first_seq = _as_int(first_seq, "first_seq", "int8")
    if first_seq < 0:
        raise ValueError(f"first_seq={first_seq} must be >= 0")
    if first_seq + n > _LANE_SEQ_LIMIT:
        raise OverflowError(
            f"lane_seq up to {first_seq + n - 1} does not fit job_id = lane_id << 40 | lane_seq (lane_seq < 2**40)"
        )
    kind_b = _text_bytes(kind, "kind")
    if metadata is None:
        meta_field = _NULL_FIELD
    elif isinstance(metadata, bytes):
        if len(metadata) >= _FIELD_MAX:
            raise OverflowError(f"metadata of {len(metadata)} bytes does not fit one COPY field")
        meta_field = _I32.pack(len(metadata) + 1) + b"\x01" + metadata
    else:
        raise TypeError(f"metadata must be bytes or None, not {type(metadata).__name__}")
    attempt = _as_int(attempt, "attempt", "int2")
    max_attempts = _as_int(max_attempts, "max_attempts", "int2")

    head = struct.pack(">hihii", 10, 2, ready_slot, 4, lane_id)
    tail = meta_field + struct.pack(">ihihii", 2, attempt, 2, max_attempts, 4, 0)
    row = struct.Struct(f">iqiqi{len(kind_b)}sib").pack
    between = tail + head
    base = lane_id << 40
    parts = [COPY_HEADER + head] if n else [COPY_HEADER]
    append = parts.append
    seq = first_seq
    for i, payload in enumerate(payloads):
        if type(payload) is not bytes and not isinstance(payload, bytes):
            raise TypeError(f"payloads[{i}] must be bytes, not {type(payload).__name__}")
        size = len(payload)
        if size >= _FIELD_MAX:
            raise OverflowError(f"payloads[{i}] of {size} bytes does not fit one COPY field")
        if i:
            append(between)
        append(row(8, seq, 8, base | seq, len(kind_b), kind_b, size + 1, 1))
        append(payload)
        seq += 1
    if n:
        append(tail)
    append(COPY_TRAILER)
    return b"".join(parts)


# --------------------------------------------------------------------------
# done_entries and lease_claim_closures

_DONE_FIELDS = ("ready_slot", "job_id", "lane_id", "lane_seq", "run_lease", "attempt", "queue", "kind")
_DONE_TYPES = ("int2", "int8", "int4", "int8", "int4", "int2")
_done_get = attrgetter(*_DONE_FIELDS)
# field count, (len, ready_slot), (len, job_id), (len, lane_id), (len, lane_seq),
# (len, run_lease), (len, attempt), (len, state)
_DONE_ROW = struct.Struct(">hihiqiiiqiiihih")

_CLOSURE_FIELDS = ("claim_slot", "claim_id", "job_id", "run_lease")
_CLOSURE_TYPES = ("int2", "int8", "int8", "int4")
_closure_get = attrgetter(*_CLOSURE_FIELDS)
# field count, (len, claim_slot), (len, claim_id), (len, job_id), (len, run_lease), (len, outcome)
_CLOSURE_ROW = struct.Struct(">hihiqiqiiih")


def _raise_row_error(i: int, names: tuple[str, ...], types: tuple[str, ...], values: tuple[Any, ...]) -> None:
    """Cold path after struct.error: raise the typed error the C module raises."""
    for name, typ, value in zip(names, types, values, strict=False):  # the int columns only
        _as_int(value, f"snapshots[{i}].{name}", typ)


def encode_done_rows(snapshots: Sequence[ClaimSnapshot]) -> bytes:
    """Binary COPY stream for ``done_entries (ready_slot, job_id, lane_id, lane_seq,
    run_lease, attempt, state, queue, kind)``, state 1 (completed) on every row."""
    parts = [COPY_HEADER]
    append = parts.append
    pack = _DONE_ROW.pack
    texts: dict[str, bytes] = {}  # queue/kind -> encoded field, shared by most rows
    for i, snap in enumerate(snapshots):
        rs, jid, lid, seq, lease, att, queue, kind = _done_get(snap)
        try:
            append(pack(9, 2, rs, 8, jid, 4, lid, 8, seq, 4, lease, 2, att, 2, _STATE_COMPLETED))
        except struct.error:
            _raise_row_error(i, _DONE_FIELDS, _DONE_TYPES, (rs, jid, lid, seq, lease, att))
            raise
        field = texts.get(queue) if type(queue) is str else None
        if field is None:
            field = texts[queue] = _text_field(queue, f"snapshots[{i}].queue")
        append(field)
        field = texts.get(kind) if type(kind) is str else None
        if field is None:
            field = texts[kind] = _text_field(kind, f"snapshots[{i}].kind")
        append(field)
    append(COPY_TRAILER)
    return b"".join(parts)


def encode_closure_rows(snapshots: Sequence[ClaimSnapshot], outcome: int) -> bytes:
    """Binary COPY stream for ``lease_claim_closures (claim_slot, claim_id, job_id,
    run_lease, outcome)``, the same ``outcome`` on every row."""
    outcome = _as_int(outcome, "outcome", "int2")
    parts = [COPY_HEADER]
    append = parts.append
    pack = _CLOSURE_ROW.pack
    for i, snap in enumerate(snapshots):
        cs, cid, jid, lease = _closure_get(snap)
        try:
            append(pack(5, 2, cs, 8, cid, 8, jid, 4, lease, 2, outcome))
        except struct.error:
            _raise_row_error(i, _CLOSURE_FIELDS, _CLOSURE_TYPES, (cs, cid, jid, lease))
            raise
    append(COPY_TRAILER)
    return b"".join(parts)


# --------------------------------------------------------------------------
# claim snapshots


# the fields claim_batch_v4 sends once per receipt (awa_fast.jobs.RECEIPT_FIELDS), by position
_RECEIPT_AT = tuple(ClaimSnapshot.__struct_fields__.index(name) for name in _RECEIPT_FIELDS)
_QUEUE_AT = _RECEIPT_AT[0]
_NREQUIRED = len(ClaimSnapshot.__struct_fields__) - len(ClaimSnapshot.__struct_defaults__)


def decode_snapshots(rows: Iterable[Sequence[Any]]) -> list[ClaimSnapshot]:
    """``[ClaimSnapshot(*row) for row in rows]``: rows in ClaimSnapshot field order.

    A row whose queue is None takes the six per-receipt fields
    (``_RECEIPT_FIELDS``) from the row before it (claim_batch_v4 sends them on
    a receipt's first row only); a full row is taken as it is. A row too
    short to be a snapshot is never carried: ``ClaimSnapshot(*row)`` refuses
    it (TypeError).
    """
    out: list[ClaimSnapshot] = []
    last: Sequence[Any] | None = None
    for row in rows:
        if len(row) >= _NREQUIRED and row[_QUEUE_AT] is None:
            if last is None:
                raise ValueError("a claim row without its receipt's columns came first; "
                                 "the claim function and the decoder disagree (run `awa-fast migrate`)")
            filled = list(row)
            for i in _RECEIPT_AT:
                filled[i] = last[i]
            row = filled
        else:
            last = row
        out.append(ClaimSnapshot(*row))
    return out


def new_jobs(snapshots: Sequence[ClaimSnapshot], args_types: dict[str, type | None],
             runtime: Any) -> list[Job[Any]]:
    """``[Job(s, args_types.get(s.kind), runtime) for s in snapshots]``: the jobs of one claim."""
    get = args_types.get
    return [Job(s, get(s.kind), runtime) for s in snapshots]


def flush_tally(pairs: Sequence[tuple[Job[Any], Any]], stale: set[tuple[int, int]], offset: float,
                committed: float, closed: list[AttemptClosed] | None,
                ) -> tuple[list[tuple[int, int]], int, dict[str, int], list[float], list[float], list[float]]:
    """One pass over a completion flush's ``(job, outcome)`` pairs (the claimer's ``flushed``).

    Returns ``(keys, completed, other, e2e, pickup, handler)``: every job's
    key, in order; how many closed as the shared ``COMPLETED`` and not
    ``stale``; the count of every other way they closed (``stale`` or the
    outcome code's ``closed_as``; a job parked for a callback counts
    nowhere); and the latency samples, in seconds on this process's clock:
    ``committed`` minus ``created_at`` (``timestamp() - offset``, converted
    once per run of equal values) for every job not stale, ``started_at``
    minus it for those whose handler started, and ``finished_at`` minus
    ``started_at`` for those whose handler returned. ``closed``, unless None,
    gets one :class:`AttemptClosed` per job that is not parked.
    """
    keys: list[tuple[int, int]] = []
    completed = 0
    other: dict[str, int] = {}
    e2e: list[float] = []
    pickup: list[float] = []
    handler: list[float] = []
    last_at: Any = None  # the created_at converted last, and its value on this process's clock
    created = 0.0
    for job, outcome in pairs:
        key = job.key
        keys.append(key)
        started = job.started_at
        if started:
            finished = getattr(job, "finished_at", 0.0)  # unset: the handler has not returned
            if finished:
                handler.append(finished - started)
        if outcome is COMPLETED and not (stale and key in stale):
            what = "completed"
            completed += 1
        elif outcome is Unwritten.PARKED:
            continue
        else:
            what = "stale" if outcome is Unwritten.STALE or (stale and key in stale) else outcome.code.closed_as
            other[what] = other.get(what, 0) + 1
        if closed is not None:
            closed.append(AttemptClosed(job.id, job.run_lease, job.kind, what, started or 0.0, committed))
        if what == "stale":
            continue
        at = job.snapshot.created_at
        if at != last_at:
            last_at = at
            created = at.timestamp() - offset
        e2e.append(committed - created)
        if started:
            pickup.append(started - created)
    return keys, completed, other, e2e, pickup, handler


def raw_jsonb(data: bytes | bytearray | memoryview) -> bytes:
    """``bytes(memoryview(data)[1:])``: a binary jsonb value as its JSON text (the version byte dropped).

    The ``load`` of the claim connection's binary jsonb loader (``runtime.claimer``): one call per
    jsonb value of a claimed row.
    """
    return bytes(memoryview(data)[1:])


def claim_summary(snapshots: Iterable[ClaimSnapshot]) -> tuple[dict[int, int], set[str]]:
    """A claim's receipts and kinds in one pass: ``claim_id -> its jobs`` (in first-seen order) and the kinds."""
    counts: dict[int, int] = {}
    kinds: set[str] = set()
    for s in snapshots:
        cid = s.claim_id
        counts[cid] = counts.get(cid, 0) + 1
        kinds.add(s.kind)
    return counts, kinds
