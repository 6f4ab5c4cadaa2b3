"""decode_copy_snapshots: a claim's binary COPY stream into ClaimSnapshots, C and Python twin alike.

The streams here are built by this file's own encoder from the PostgreSQL
binary COPY format (signature, flags, header extension; per row an int16
field count and int32-length fields, -1 for NULL; the int16 trailer), with
each column in its binary send format: int8/int4 big-endian, text UTF-8,
jsonb a version byte 1 then the JSON text, timestamptz int8 microseconds
from 2000-01-01 UTC. The decoders must give ``ClaimSnapshot(*fields)`` with
the types the claim connection's binary cursor gives (jsonb: the raw text, as
``storage.types``' raw loader returns it; timestamptz: an aware datetime in
UTC), take a last row whose job_id is NULL off as the backlog marker, and
raise the same ``ValueError`` (type and message) for a stream that is not a
whole claim COPY, without crashing. The row path is compared with on a real
server in tests/integration/test_claim_copy.py.
"""

from __future__ import annotations

import datetime as dt
import struct
import types
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import awa_fast._pycodec as pycodec
from awa_fast.jobs import ClaimSnapshot
from tests.unit.test_codec import _require_c, outcome

HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8
TRAILER = b"\xff\xff"
PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
NULL = b"\xff\xff\xff\xff"
# the claim's columns, in ClaimSnapshot field order
TYPES = ("int8", "int4", "int4", "int4", "text", "text", "int4", "jsonb", "jsonb", "int4", "int4", "int8", "int4",
         "int8", "timestamptz", "jsonb", "jsonb", "jsonb")
FIELDS = ClaimSnapshot.__struct_fields__


@pytest.fixture(scope="module", params=["c", "python"])
def codec(request: pytest.FixtureRequest) -> types.ModuleType:
    return _require_c() if request.param == "c" else pycodec


@pytest.fixture(scope="module")
def c_codec() -> types.ModuleType:
    return _require_c()


def field(typ: str, value: Any) -> bytes:
    if value is None:
        return NULL
    if typ == "int8":
        return struct.pack(">iq", 8, value)
    if typ == "int4":
        return struct.pack(">ii", 4, value)
    if typ == "text":
        data = value.encode()
        return struct.pack(">i", len(data)) + data
    if typ == "jsonb":
        return struct.pack(">ib", len(value) + 1, 1) + value
    micros = (value - PG_EPOCH) // dt.timedelta(microseconds=1)
    return struct.pack(">iq", 8, micros)


def row(values: tuple[Any, ...]) -> bytes:
    return struct.pack(">h", len(values)) + b"".join(field(t, v) for t, v in zip(TYPES, values, strict=True))


def stream(rows: list[tuple[Any, ...]], marker: bool = False) -> bytes:
    body = b"".join(row(r) for r in rows)
    if marker:
        body += row((None,) * len(TYPES))
    return HEADER + body + TRAILER


def values(job_id: int = 1099511627777, **kw: Any) -> tuple[Any, ...]:
    base = dict(job_id=job_id, run_lease=1, attempt=1, max_attempts=25, queue="q", kind="k", priority=2,
                args=b'{"n": 1}', metadata=None, ready_slot=3, lane_id=1, lane_seq=1, claim_slot=0, claim_id=77,
                created_at=dt.datetime(2026, 12, 1, 20, 0, 0, 123456, tzinfo=dt.UTC), errors=None,
                callback_result=None, progress=None)
    base.update(kw)
    return tuple(base[f] for f in FIELDS)


def check_types(snap: ClaimSnapshot, want: tuple[Any, ...]) -> None:
    for name, value in zip(FIELDS, want, strict=True):
        got = getattr(snap, name)
        assert type(got) is type(value), (name, got, value)
        assert got == value, (name, got, value)
    assert snap.created_at.tzinfo is dt.UTC


texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
jsonb = st.one_of(st.none(), st.binary(max_size=300), st.just(b'[{"attempt": 1, "error": "b\xc3\xb6\xc3\xb6m"}]'))
times = st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59, 999999),
                     timezones=st.just(dt.UTC))
snapshot_values = st.tuples(
    st.integers(-(2**63), 2**63 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1),
    st.integers(-(2**31), 2**31 - 1), texts, texts, st.integers(-(2**31), 2**31 - 1), st.binary(max_size=300),
    jsonb, st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1), st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**31), 2**31 - 1), st.integers(-(2**63), 2**63 - 1), times, jsonb, jsonb, jsonb)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(snapshot_values, max_size=12), st.booleans())
def test_decoders_give_the_snapshots_field_for_field(rows: list[tuple[Any, ...]], marker: bool) -> None:
    data = stream(rows, marker)
    want = [ClaimSnapshot(*r) for r in rows]
    for codec in (pycodec, _require_c()):
        snaps, seen = codec.decode_copy_snapshots(data)
        assert snaps == want and seen is marker
        assert all(type(s) is ClaimSnapshot for s in snaps)
        for snap, r in zip(snaps, rows, strict=True):
            check_types(snap, r)


def test_the_values_a_claim_carries(codec: types.ModuleType) -> None:
    rows = [
        values(),
        values(job_id=2**62 + 5, queue="é ✓ \U0001f600", kind="k.big", args=b'{"blob": "' + b"x" * 300_000 + b'"}',
               metadata=b'{"trace": "t"}', priority=-3, lane_seq=2**40 - 1, claim_id=2**63 - 1),
        values(errors=b'[{"attempt": 1, "error": "boom"}]', callback_result=b'{"answer": 42}',
               progress=b'{"step": 2}', attempt=2, run_lease=3),
        values(args=b"", created_at=dt.datetime(1, 1, 1, tzinfo=dt.UTC)),  # an empty jsonb text, the earliest time
        values(created_at=dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC)),
        values(created_at=dt.datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC)),  # before the PG epoch
        values(created_at=dt.datetime(2000, 2, 29, 12, 0, tzinfo=dt.UTC)),
        values(created_at=dt.datetime(1900, 3, 1, tzinfo=dt.UTC)),
    ]
    snaps, seen = codec.decode_copy_snapshots(stream(rows))
    assert seen is False and len(snaps) == len(rows)
    for snap, r in zip(snaps, rows, strict=True):
        check_types(snap, r)
    assert codec.decode_copy_snapshots(bytearray(stream(rows)))[0] == snaps
    assert codec.decode_copy_snapshots(memoryview(stream(rows)))[0] == snaps


def test_the_backlog_marker(codec: types.ModuleType) -> None:
    assert codec.decode_copy_snapshots(stream([])) == ([], False)
    assert codec.decode_copy_snapshots(stream([], marker=True)) == ([], True)
    snaps, seen = codec.decode_copy_snapshots(stream([values(), values(job_id=9)], marker=True))
    assert [s.job_id for s in snaps] == [1099511627777, 9] and seen is True
    # a NULL job_id only counts as the marker on the last row, as on the row path
    snaps, seen = codec.decode_copy_snapshots(stream([values(job_id=None), values(job_id=9)]))
    assert [s.job_id for s in snaps] == [None, 9] and seen is False


def test_shared_values_are_equal_objects(codec: types.ModuleType) -> None:
    """Equal consecutive created_at, queue and kind may share one object; every field still equals its row."""
    t = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = [values(job_id=i, created_at=t, queue="q" if i < 3 else "r", claim_id=5) for i in range(6)]
    snaps, _ = codec.decode_copy_snapshots(stream(rows))
    assert [ClaimSnapshot(*r) for r in rows] == snaps
    assert [s.queue for s in snaps] == ["q", "q", "q", "r", "r", "r"]


def _malformed_cases() -> dict[str, bytes]:
    good = stream([values(), values(job_id=2)])
    one = row(values())
    flags = lambda f: good[:11] + struct.pack(">I", f) + good[15:]  # noqa: E731
    return {
        "empty": b"",
        "signature": b"PGCOPY\n\xff\r\n\x01" + good[11:],
        "oids flag": flags(1 << 16),
        "critical flag": flags(1 << 31),
        "header extension too long": good[:15] + struct.pack(">i", 10_000) + good[19:],
        "negative header extension": good[:15] + struct.pack(">i", -1) + good[19:],
        "no trailer": good[:-2],
        "bytes after the trailer": good + b"\x00",
        "17 fields": HEADER + struct.pack(">h", 17) + one[2:] + TRAILER,
        "19 fields": HEADER + struct.pack(">h", 19) + one[2:] + NULL + TRAILER,
        "int4 of 8 bytes": HEADER + one[:2] + field("int8", 1) + struct.pack(">iq", 8, 1) + one[2 + 12 + 8:] + TRAILER,
        "int8 of 4 bytes": HEADER + one[:2] + field("int4", 1) + one[2 + 12:] + TRAILER,
        "field past the end": HEADER + one[:2] + struct.pack(">i", 10**6) + one[6:] + TRAILER,
        "negative length": HEADER + one[:2] + struct.pack(">i", -2) + one[6:] + TRAILER,
        "invalid utf-8 queue": stream([values()]).replace(b"\x00\x00\x00\x01q", b"\x00\x00\x00\x01\xff", 1),
        "timestamp after 9999": HEADER + row(values())[:-(4 * 3 + 12)] + struct.pack(">iq", 8, 2**62)
        + NULL * 3 + TRAILER,
        "timestamp before 1": HEADER + row(values())[:-(4 * 3 + 12)] + struct.pack(">iq", 8, -(2**62))
        + NULL * 3 + TRAILER,
    }


@pytest.mark.parametrize("case", sorted(_malformed_cases()))
def test_malformed_streams_raise_the_same_typed_error(c_codec: types.ModuleType, case: str) -> None:
    data = _malformed_cases()[case]
    got = outcome(c_codec.decode_copy_snapshots, data)
    assert got == outcome(pycodec.decode_copy_snapshots, data)
    assert got[0] == "err" and issubclass(got[1], ValueError), got
    if case != "invalid utf-8 queue":
        assert got[1] is ValueError and got[2].startswith("malformed claim COPY stream: "), got


def test_every_truncation_and_byte_flip_is_an_error_or_a_result_alike(c_codec: types.ModuleType) -> None:
    good = stream([values(), values(errors=b"[1]", queue="qé"), values(job_id=None)])
    for n in range(len(good)):
        cut = good[:n]
        got = outcome(c_codec.decode_copy_snapshots, cut)
        assert got == outcome(pycodec.decode_copy_snapshots, cut), n
        assert got[0] == "err"
    for i in range(len(good)):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(good)
            bad[i] ^= flip
            assert outcome(c_codec.decode_copy_snapshots, bytes(bad)) == outcome(pycodec.decode_copy_snapshots,
                                                                              bytes(bad)), (i, flip)


def test_not_bytes(codec: types.ModuleType) -> None:
    for bad in ("PGCOPY", None, 5, [b"x"]):
        with pytest.raises(TypeError, match="data must be a bytes-like object"):
            codec.decode_copy_snapshots(bad)
