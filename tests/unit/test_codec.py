"""The codec: C extension and pure-Python twin, one suite for both.

Every test runs against both implementations (``codec`` fixture), and the
``*_identical`` tests run both on the same generated inputs and demand the same
bytes, or the same exception type and message. The C param is skipped when the
extension is not built, unless the session asked for ``AWA_FAST_IMPL=c``: then
a missing extension fails.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import pathlib
import struct
import subprocess
import sys
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import awa_fast
import awa_fast._pycodec as pycodec
from awa_fast.errors import PayloadError
from awa_fast.jobs import CLOSURE_COMPLETED, AttemptClosed, ClaimSnapshot, Job
from awa_fast.outcomes import COMPLETED, CloseCode, Outcome, Unwritten

ccodec: types.ModuleType | None
try:
    import awa_fast._codec as _c_module
except ImportError as exc:  # pragma: no cover - depends on the install
    ccodec = None
    _C_MISSING = f"C extension awa_fast._codec is not built ({exc})"
else:
    ccodec = _c_module
    _C_MISSING = ""

HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8
TRAILER = b"\xff\xff"
NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
PACKAGE_ROOT = pathlib.Path(awa_fast.__file__).resolve().parent.parent

I16 = (-(2**15), 2**15 - 1)
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


def _require_c() -> types.ModuleType:
    if ccodec is None:
        if os.environ.get("AWA_FAST_IMPL", "").strip() == "c":
            pytest.fail(f"AWA_FAST_IMPL=c but {_C_MISSING}")
        pytest.skip(_C_MISSING)
    return ccodec


@pytest.fixture(scope="module", params=["c", "python"])
def codec(request: pytest.FixtureRequest) -> types.ModuleType:
    """Each implementation in turn."""
    return _require_c() if request.param == "c" else pycodec


@pytest.fixture(scope="module")
def c_codec() -> types.ModuleType:
    """The C implementation (for C-vs-Python comparisons)."""
    return _require_c()


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """What a call did: ("ok", result) or ("err", type, message, path)."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - compared, not swallowed
        return ("err", type(exc), str(exc), getattr(exc, "path", None))


def parse_copy(buf: bytes) -> list[list[bytes | None]]:
    """Decode a binary COPY stream into rows of raw field bytes (None = NULL)."""
    assert buf[:19] == HEADER
    pos, rows = 19, []
    while True:
        (nfields,) = struct.unpack_from(">h", buf, pos)
        pos += 2
        if nfields == -1:
            break
        row: list[bytes | None] = []
        for _ in range(nfields):
            (size,) = struct.unpack_from(">i", buf, pos)
            pos += 4
            if size == -1:
                row.append(None)
            else:
                row.append(buf[pos : pos + size])
                pos += size
        rows.append(row)
    assert pos == len(buf), "bytes after the trailer"
    return rows


def val(field: bytes | None) -> bytes:
    """A non-NULL field."""
    assert field is not None
    return field


def snapshot(i: int = 0, **over: Any) -> ClaimSnapshot:
    fields: dict[str, Any] = dict(
        job_id=(7 << 40) | (100 + i),
        run_lease=1 + i,
        attempt=1,
        max_attempts=25,
        queue="default",
        kind="send_email",
        priority=2,
        args=b'{"a":1}',
        metadata=None,
        ready_slot=3,
        lane_id=7,
        lane_seq=100 + i,
        claim_slot=4,
        claim_id=9000 + i,
        created_at=NOW,
    )
    fields.update(over)
    return ClaimSnapshot(**fields)


def as_row(s: ClaimSnapshot) -> tuple[Any, ...]:
    return tuple(getattr(s, f) for f in s.__struct_fields__)


# --------------------------------------------------------------------------
# framing and hand-decoded rows


def test_copy_header_and_trailer_constants(codec: types.ModuleType) -> None:
    assert codec.COPY_HEADER == HEADER
    assert len(codec.COPY_HEADER) == 19
    assert codec.COPY_TRAILER == TRAILER


def test_empty_streams_are_header_plus_trailer(codec: types.ModuleType) -> None:
    assert codec.encode_done_rows([]) == HEADER + TRAILER
    assert codec.encode_closure_rows([], 1) == HEADER + TRAILER
    assert codec.encode_ready_rows(0, 1, 1, "k", [], None, 0, 1) == HEADER + TRAILER


def test_ready_row_hand_decoded(codec: types.ModuleType) -> None:
    buf = codec.encode_ready_rows(3, 7, 100, "send_email", [b'{"x":1}', b"[]"], b'{"m":true}', 0, 25)
    assert buf.startswith(HEADER) and buf.endswith(TRAILER)
    # first row, byte for byte
    expected_row0 = (
        b"\x00\x0a"
        + b"\x00\x00\x00\x02\x00\x03"
        + b"\x00\x00\x00\x04\x00\x00\x00\x07"
        + b"\x00\x00\x00\x08"
        + (100).to_bytes(8, "big")
        + b"\x00\x00\x00\x08"
        + ((7 << 40) | 100).to_bytes(8, "big")
        + b"\x00\x00\x00\x0a"
        + b"send_email"
        + b"\x00\x00\x00\x08\x01"
        + b'{"x":1}'
        + b"\x00\x00\x00\x0b\x01"
        + b'{"m":true}'
        + b"\x00\x00\x00\x02\x00\x00"
        + b"\x00\x00\x00\x02\x00\x19"
        + b"\x00\x00\x00\x04\x00\x00\x00\x00"
    )
    assert buf[19 : 19 + len(expected_row0)] == expected_row0
    rows = parse_copy(buf)
    assert len(rows) == 2
    r = rows[1]
    assert len(r) == 10
    assert struct.unpack(">h", val(r[0])) == (3,)
    assert struct.unpack(">i", val(r[1])) == (7,)
    assert struct.unpack(">q", val(r[2])) == (101,)
    assert struct.unpack(">q", val(r[3])) == ((7 << 40) | 101,)
    assert r[4] == b"send_email"
    assert r[5] == b"\x01[]"
    assert r[6] == b'\x01{"m":true}'
    assert struct.unpack(">hhi", val(r[7]) + val(r[8]) + val(r[9])) == (0, 25, 0)


def test_ready_row_null_metadata(codec: types.ModuleType) -> None:
    (row,) = parse_copy(codec.encode_ready_rows(0, 0, 0, "k", [b"{}"], None, 1, 1))
    assert row[6] is None
    assert struct.unpack(">q", val(row[3])) == (0,)


def test_done_row_hand_decoded(codec: types.ModuleType) -> None:
    snaps = [snapshot(0), snapshot(1, queue="q\u00e9", kind="k\U0001f600", ready_slot=-1)]
    rows = parse_copy(codec.encode_done_rows(snaps))
    assert len(rows) == 2
    r = rows[1]
    assert len(r) == 9
    assert struct.unpack(">h", val(r[0])) == (-1,)
    assert struct.unpack(">q", val(r[1])) == ((7 << 40) | 101,)
    assert struct.unpack(">i", val(r[2])) == (7,)
    assert struct.unpack(">q", val(r[3])) == (101,)
    assert struct.unpack(">i", val(r[4])) == (2,)
    assert struct.unpack(">h", val(r[5])) == (1,)
    assert struct.unpack(">h", val(r[6])) == (1,)  # state: completed
    assert r[7] == "q\u00e9".encode()
    assert r[8] == "k\U0001f600".encode()


def test_closure_row_hand_decoded(codec: types.ModuleType) -> None:
    buf = codec.encode_closure_rows([snapshot(5)], CLOSURE_COMPLETED)
    assert buf == (
        HEADER
        + b"\x00\x05"
        + b"\x00\x00\x00\x02\x00\x04"
        + b"\x00\x00\x00\x08"
        + (9005).to_bytes(8, "big")
        + b"\x00\x00\x00\x08"
        + ((7 << 40) | 105).to_bytes(8, "big")
        + b"\x00\x00\x00\x04\x00\x00\x00\x06"
        + b"\x00\x00\x00\x02\x00\x01"
        + TRAILER
    )


def test_encoders_accept_iterables_and_duck_types(codec: types.ModuleType) -> None:
    snaps = [snapshot(i) for i in range(3)]
    ducks = [types.SimpleNamespace(**{f: getattr(s, f) for f in s.__struct_fields__}) for s in snaps]
    assert (
        codec.encode_done_rows(iter(snaps)) == codec.encode_done_rows(ducks) == codec.encode_done_rows(snaps)
    )
    assert codec.encode_closure_rows(tuple(snaps), 2) == codec.encode_closure_rows(ducks, 2)
    payloads = [b"{}", b"[1]"]
    assert codec.encode_ready_rows(1, 2, 3, "k", iter(payloads), None, 0, 1) == codec.encode_ready_rows(
        1, 2, 3, "k", tuple(payloads), None, 0, 1
    )


# --------------------------------------------------------------------------
# range and type errors


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((2**15, 1, 0, "k", [], None, 0, 1), OverflowError, r"ready_slot=32768 does not fit int2"),
        ((0, 2**31, 0, "k", [], None, 0, 1), OverflowError, r"lane_id=2147483648 does not fit int4"),
        ((0, -1, 0, "k", [], None, 0, 1), ValueError, r"lane_id=-1 must be >= 0"),
        ((0, 2**23, 0, "k", [], None, 0, 1), OverflowError, r"lane_id < 2\*\*23"),
        ((0, 1, -5, "k", [], None, 0, 1), ValueError, r"first_seq=-5 must be >= 0"),
        (
            (0, 1, 2**63, "k", [], None, 0, 1),
            OverflowError,
            r"first_seq=9223372036854775808 does not fit int8",
        ),
        ((0, 1, 2**40 - 1, "k", [b"{}", b"{}"], None, 0, 1), OverflowError, r"lane_seq < 2\*\*40"),
        ((0, 1, 0, "k", [], None, 2**15, 1), OverflowError, r"attempt=32768 does not fit int2"),
        ((0, 1, 0, "k", [], None, 0, -(2**15) - 1), OverflowError, r"max_attempts=-32769"),
        ((1.0, 1, 0, "k", [], None, 0, 1), TypeError, r"ready_slot must be an int, not float"),
        ((0, 1, 0, b"k", [], None, 0, 1), TypeError, r"kind must be a str, not bytes"),
        ((0, 1, 0, "k\x00", [], None, 0, 1), ValueError, r"kind contains NUL"),
        ((0, 1, 0, "k\ud800", [], None, 0, 1), UnicodeEncodeError, r"surrogates not allowed"),
        ((0, 1, 0, "k", [b"{}", "x"], None, 0, 1), TypeError, r"payloads\[1\] must be bytes, not str"),
        ((0, 1, 0, "k", [], "{}", 0, 1), TypeError, r"metadata must be bytes or None, not str"),
        ((0, 1, 0, "k", 5, None, 0, 1), TypeError, r"not iterable"),
    ],
)
def test_ready_rows_errors(codec: types.ModuleType, args: tuple[Any, ...], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        codec.encode_ready_rows(*args)


def test_ready_rows_edges_accepted(codec: types.ModuleType) -> None:
    rows = parse_copy(codec.encode_ready_rows(I16[0], 2**23 - 1, 2**40 - 1, "k", [b"1"], None, True, I16[1]))
    assert struct.unpack(">q", val(rows[0][3])) == (((2**23 - 1) << 40) | (2**40 - 1),)
    assert struct.unpack(">h", val(rows[0][7])) == (1,)  # bool is an int


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        ({"ready_slot": 2**15}, OverflowError, r"snapshots\[1\]\.ready_slot=32768 does not fit int2"),
        ({"job_id": 2**63}, OverflowError, r"snapshots\[1\]\.job_id=9223372036854775808 does not fit int8"),
        ({"lane_id": -(2**31) - 1}, OverflowError, r"snapshots\[1\]\.lane_id"),
        ({"run_lease": 2**31}, OverflowError, r"snapshots\[1\]\.run_lease"),
        ({"attempt": 2**100}, OverflowError, r"snapshots\[1\]\.attempt=1267650600228229401496703205376 "),
        ({"attempt": 2**300}, OverflowError, r"attempt=<301-bit int> does not fit int2"),
        ({"lane_seq": "1"}, TypeError, r"snapshots\[1\]\.lane_seq must be an int, not str"),
        ({"queue": None}, TypeError, r"snapshots\[1\]\.queue must be a str, not NoneType"),
        ({"kind": "a\x00b"}, ValueError, r"snapshots\[1\]\.kind contains NUL"),
        ({"queue": "\udfff"}, UnicodeEncodeError, r"surrogates not allowed"),
        # the first bad column wins: ready_slot is checked before queue
        ({"queue": 5, "ready_slot": 2**20}, OverflowError, r"ready_slot"),
    ],
)
def test_done_rows_errors(codec: types.ModuleType, over: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        codec.encode_done_rows([snapshot(0), snapshot(1, **over)])


def test_done_rows_text_checked_on_first_row(codec: types.ModuleType) -> None:
    with pytest.raises(TypeError, match=r"snapshots\[0\]\.queue must be a str, not NoneType"):
        codec.encode_done_rows([snapshot(queue=None)])
    with pytest.raises(TypeError, match=r"snapshots\[0\]\.kind must be a str, not NoneType"):
        codec.encode_done_rows([snapshot(kind=None)])


def test_done_rows_missing_attribute(codec: types.ModuleType) -> None:
    with pytest.raises(AttributeError):
        codec.encode_done_rows([snapshot(0), types.SimpleNamespace(ready_slot=1)])


def test_closure_rows_errors(codec: types.ModuleType) -> None:
    with pytest.raises(OverflowError, match=r"outcome=40000 does not fit int2"):
        codec.encode_closure_rows([snapshot()], 40000)
    with pytest.raises(OverflowError, match=r"snapshots\[0\]\.claim_slot=-40000"):
        codec.encode_closure_rows([snapshot(claim_slot=-40000)], 1)
    with pytest.raises(TypeError, match=r"snapshots\[0\]\.claim_id must be an int, not float"):
        codec.encode_closure_rows([snapshot(claim_id=1.5)], 1)


class _Index:
    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_index_objects_are_ints(codec: types.ModuleType) -> None:
    a = codec.encode_closure_rows([snapshot(claim_slot=_Index(4))], _Index(1))
    assert a == codec.encode_closure_rows([snapshot()], 1)


# --------------------------------------------------------------------------
# C and Python agree, byte for byte and error for error

_int2 = st.one_of(st.integers(*I16), st.integers(-(2**17), 2**17))
_int4 = st.one_of(st.integers(*I32), st.integers(-(2**33), 2**33))
_int8 = st.one_of(st.integers(*I64), st.integers(-(2**65), 2**65))
_odd = st.one_of(st.none(), st.floats(allow_nan=False), st.text(max_size=2), st.booleans())
_texts = st.one_of(st.text(max_size=12), st.sampled_from(["default", "send_email", "q\u00e9", "\U0001f600"]))
_sometimes_odd: Callable[[st.SearchStrategy[Any]], st.SearchStrategy[Any]] = lambda s: st.one_of(  # noqa: E731
    s, s, s, _odd
)
_IDENTICAL = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same(c: types.ModuleType, fn: str, *args: Any) -> tuple[Any, ...]:
    got_c = outcome(getattr(c, fn), *args)
    got_py = outcome(getattr(pycodec, fn), *args)
    assert got_c == got_py
    return got_c


@_IDENTICAL
@given(
    ready_slot=_int2,
    lane_id=st.one_of(st.integers(0, 2**23 - 1), _int4),
    first_seq=st.one_of(st.integers(0, 2**40 - 64), _int8),
    kind=_sometimes_odd(_texts),
    payloads=st.lists(
        st.one_of(st.binary(max_size=40), st.binary(max_size=40), st.text(max_size=2)), max_size=20
    ),
    metadata=st.one_of(st.none(), st.binary(max_size=30), st.text(max_size=3)),
    attempt=_int2,
    max_attempts=_int2,
)
def test_ready_rows_identical(
    c_codec: types.ModuleType,
    ready_slot: int,
    lane_id: int,
    first_seq: int,
    kind: str,
    payloads: list[bytes],
    metadata: bytes | None,
    attempt: int,
    max_attempts: int,
) -> None:
    got = _same(
        c_codec,
        "encode_ready_rows",
        ready_slot,
        lane_id,
        first_seq,
        kind,
        payloads,
        metadata,
        attempt,
        max_attempts,
    )
    if got[0] == "ok":
        rows = parse_copy(got[1])
        assert len(rows) == len(payloads)
        for i, row in enumerate(rows):
            seq = first_seq + i
            assert struct.unpack(">qq", val(row[2]) + val(row[3])) == (seq, (lane_id << 40) | seq)
            assert row[5] == b"\x01" + payloads[i]


_snapshots = st.builds(
    ClaimSnapshot,
    job_id=_sometimes_odd(_int8),
    run_lease=_sometimes_odd(_int4),
    attempt=_sometimes_odd(_int2),
    max_attempts=_int2,
    queue=_sometimes_odd(_texts),
    kind=_sometimes_odd(_texts),
    priority=st.integers(0, 4),
    args=st.binary(max_size=8),
    metadata=st.none(),
    ready_slot=_sometimes_odd(_int2),
    lane_id=_sometimes_odd(_int4),
    lane_seq=_sometimes_odd(_int8),
    claim_slot=_sometimes_odd(_int2),
    claim_id=_sometimes_odd(_int8),
    created_at=st.just(NOW),
)


@_IDENTICAL
@given(snaps=st.lists(_snapshots, max_size=12), outcome_code=_int2)
def test_done_and_closure_rows_identical(
    c_codec: types.ModuleType, snaps: list[ClaimSnapshot], outcome_code: int
) -> None:
    _same(c_codec, "encode_done_rows", snaps)
    _same(c_codec, "encode_closure_rows", snaps, outcome_code)


@_IDENTICAL
@given(snaps=st.lists(_snapshots, min_size=1, max_size=6))
def test_rows_identical_through_getattr(c_codec: types.ModuleType, snaps: list[ClaimSnapshot]) -> None:
    """Objects that are not exactly ClaimSnapshot take the getattr path in C."""
    ducks = [types.SimpleNamespace(**{f: getattr(s, f) for f in s.__struct_fields__}) for s in snaps]
    assert outcome(c_codec.encode_done_rows, ducks) == outcome(c_codec.encode_done_rows, snaps)
    assert outcome(c_codec.encode_closure_rows, ducks, 1) == outcome(c_codec.encode_closure_rows, snaps, 1)
    _same(c_codec, "encode_done_rows", ducks)


# --------------------------------------------------------------------------
# check_payload

_good_text = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=10
)
_good_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(*I64),
    st.floats(allow_nan=False, allow_infinity=False),
    _good_text,
)
_good_json = st.recursive(
    _good_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(_good_text, inner, max_size=4),
    ),
    max_leaves=25,
)
_any_scalar = st.one_of(
    _good_scalar,
    st.floats(),
    st.integers(),
    st.text(max_size=6),
    st.sampled_from(["\x00", "a\ud800", "\udc00\x00", "\u00e9\x00", b"bytes", 1j, set(), OrderedDict(a=1)]),
)
_any_json = st.recursive(
    _any_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(0, 3)), inner, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(value=_good_json)
def test_check_payload_accepts_valid(codec: types.ModuleType, value: Any) -> None:
    assert codec.check_payload(value, 512) is None
    json.dumps(value, allow_nan=False)  # and it really is JSON


@_IDENTICAL
@given(value=_any_json, max_depth=st.integers(0, 6))
def test_check_payload_identical(c_codec: types.ModuleType, value: Any, max_depth: int) -> None:
    _same(c_codec, "check_payload", value, max_depth)


class _MyStr(str):
    pass


class _MyDict(dict):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    ("value", "path", "match"),
    [
        ({"a": [1, {"b": float("nan")}]}, "$.a[1].b", "float nan is not valid JSON"),
        ([float("inf")], "$[0]", "float inf is not valid JSON"),
        ({"x": -float("inf")}, "$.x", "float -inf"),
        ({"a": "x\x00y"}, "$.a", r"str contains NUL \(\\u0000\)"),
        ({"a\x00": 1}, '$["a\\u0000"]', r"dict key contains NUL"),
        ({"a": ["\u00e9\ud83d"]}, "$.a[0]", r"str contains lone surrogate U\+D83D"),
        ({"k\udc00": 1}, '$["k\\udc00"]', r"dict key contains lone surrogate U\+DC00"),
        ({"a": {1: 2}}, "$.a", "dict key of type int is not a str"),
        ({"a": b"x"}, "$.a", "unsupported type bytes"),
        ({"a": _MyStr("x")}, "$.a", "unsupported type _MyStr"),
        ([_MyDict()], "$[0]", "unsupported type _MyDict"),
        ({"n": 2**63}, "$.n", "int outside the signed 64-bit range"),
        ({"n": -(2**63) - 1}, "$.n", "int outside the signed 64-bit range"),
        ({"with space": {"ok_1": [[]]}}, '$["with space"].ok_1[0]', "nesting deeper than max_depth=3"),
        ({"é": {"": 1.5, "z": {1}}}, '$["\\u00e9"].z', "unsupported type set"),
        (float("nan"), "$", "float nan"),
    ],
)
def test_check_payload_rejects(codec: types.ModuleType, value: Any, path: str, match: str) -> None:
    with pytest.raises(PayloadError, match=match) as info:
        codec.check_payload(value, 3)
    assert info.value.path == path


def test_check_payload_edges(codec: types.ModuleType) -> None:
    codec.check_payload({"n": 2**63 - 1, "m": -(2**63), "t": (1, [None, True]), "s": "\U0001f600\u00e9"})
    codec.check_payload(5, max_depth=0)
    with pytest.raises(PayloadError, match="max_depth=0"):
        codec.check_payload([], max_depth=0)
    deep: Any = 1
    for _ in range(32):
        deep = [deep]
    codec.check_payload(deep)  # 32 containers: the default limit
    with pytest.raises(PayloadError, match="max_depth=32"):
        codec.check_payload([deep])
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(PayloadError, match="nesting deeper"):
        codec.check_payload(loop)
    with pytest.raises(ValueError, match="max_depth=-1 must be in 0..512"):
        codec.check_payload({}, -1)
    with pytest.raises(ValueError, match="max_depth=513"):
        codec.check_payload({}, 513)
    with pytest.raises(TypeError):
        codec.check_payload({}, 1.5)


# --------------------------------------------------------------------------
# decode_snapshots


def test_decode_snapshots_matches_constructor(codec: types.ModuleType) -> None:
    snaps = [snapshot(i, errors=b"[]" if i % 2 else None) for i in range(50)]
    rows = [as_row(s) for s in snaps]
    got = codec.decode_snapshots(rows)
    assert got == snaps
    assert all(type(s) is ClaimSnapshot for s in got)
    assert codec.decode_snapshots(iter(rows)) == snaps
    assert codec.decode_snapshots([list(r) for r in rows]) == snaps
    assert codec.decode_snapshots([]) == []


def test_decode_snapshots_defaults_and_arity(codec: types.ModuleType) -> None:
    (short,) = codec.decode_snapshots([as_row(snapshot())[:15]])
    assert short == snapshot()
    assert short.errors is None and short.callback_result is None
    for bad in (as_row(snapshot())[:14], as_row(snapshot()) + (1,)):
        with pytest.raises(TypeError):
            codec.decode_snapshots([bad])
    with pytest.raises(TypeError):
        codec.decode_snapshots([5])


def test_decode_snapshots_references(codec: types.ModuleType) -> None:
    marker = object()
    row = as_row(snapshot(args=marker))
    before = sys.getrefcount(marker)
    out = codec.decode_snapshots([row] * 5)
    assert sys.getrefcount(marker) == before + 5
    assert out[0].args is marker
    hash(out[0])  # frozen structs hash
    del out
    assert sys.getrefcount(marker) == before


RECEIPT_FIELDS = ("queue", "priority", "ready_slot", "lane_id", "claim_slot", "claim_id")


def _receipt_rows(snaps: list[ClaimSnapshot]) -> list[tuple[Any, ...]]:
    """Rows as claim_batch_v4 sends them: a receipt's columns on its first row only."""
    rows = []
    prev: tuple[Any, ...] | None = None
    for s in snaps:
        mine = tuple(getattr(s, f) for f in RECEIPT_FIELDS)
        row = as_row(s)
        if mine == prev:
            row = tuple(None if f in RECEIPT_FIELDS else v for f, v in zip(s.__struct_fields__, row))
        prev = mine
        rows.append(row)
    return rows


def test_decode_snapshots_carries_a_receipts_columns(codec: types.ModuleType) -> None:
    """Rows after a receipt's first take its six per-receipt fields (claim_batch_v4)."""
    first = [snapshot(i, claim_id=9000) for i in range(5)]
    second = [snapshot(i + 5, queue="other", priority=0, ready_slot=9, lane_id=11, claim_slot=2,
                       claim_id=1 << 33) for i in range(4)]
    snaps = first + second
    rows = _receipt_rows(snaps)
    assert sum(r[4] is None for r in rows) == 7  # only the two receipts' first rows are full
    for shape in (rows, [list(r) for r in rows], iter(rows)):
        got = codec.decode_snapshots(shape)
        assert got == snaps
        assert all(type(s) is ClaimSnapshot for s in got)
    got = codec.decode_snapshots(rows)
    # the receipt's values are the first row's objects, shared, not copies
    assert all(g.claim_id is got[5].claim_id for g in got[5:])
    assert got[5].claim_id is rows[5][13]


def test_decode_snapshots_carry_references(codec: types.ModuleType) -> None:
    queue = "q-" + str(id(object()))  # a str of its own, so its count is ours
    snaps = [snapshot(i, queue=queue, claim_id=9000) for i in range(4)]
    rows = _receipt_rows(snaps)
    del snaps
    before = sys.getrefcount(queue)
    out = codec.decode_snapshots(rows)
    assert sys.getrefcount(queue) == before + 4
    assert [s.queue for s in out] == [queue] * 4
    del out
    assert sys.getrefcount(queue) == before


def test_decode_snapshots_refuses_a_first_row_without_receipt_columns(codec: types.ModuleType) -> None:
    rows = _receipt_rows([snapshot(0, claim_id=9000), snapshot(1, claim_id=9000)])
    with pytest.raises(ValueError, match="awa-fast migrate"):
        codec.decode_snapshots(rows[1:])
    with pytest.raises(ValueError, match="awa-fast migrate"):
        codec.decode_snapshots([list(rows[1])])


def test_decode_snapshots_refuses_short_rows_without_carrying(codec: types.ModuleType) -> None:
    """A row too short to be a snapshot is a TypeError, also with None where the queue goes (never carried)."""
    full = as_row(snapshot(0))
    for length in range(0, 15):
        for shape in (tuple, list):
            row = shape(full[:length])
            if length > 4:
                row = shape((*row[:4], None, *row[5:]))
            with pytest.raises(TypeError):
                codec.decode_snapshots([full, row])
            with pytest.raises(TypeError):
                codec.decode_snapshots([row])


def test_decode_snapshots_holds_a_row_whose_indexing_drops_the_lists_reference(codec: types.ModuleType) -> None:
    """Indexing a row that is not exactly a tuple runs Python code, which may drop the list's reference
    to it; the decoder keeps its own reference while it uses the row (else it reads freed memory).

    Inside ``__getitem__``, after the list let go, the row is held by the call's frame and
    ``getrefcount``'s argument, and by the decoder only if it took a reference of its own.
    """
    full = as_row(snapshot(0))
    rows: list[Any] = []
    held: list[int] = []

    class Row(tuple):  # type: ignore[type-arg]
        def __getitem__(self, i: Any) -> Any:
            if rows:
                rows.clear()
                held.append(sys.getrefcount(self))
            return tuple.__getitem__(self, i)

    rows.append(Row(full))
    got = codec.decode_snapshots(rows)
    assert held and held[0] >= 3, held
    assert got == [snapshot(0)]


def test_c_uses_fast_snapshot_layout(c_codec: types.ModuleType) -> None:
    """If ClaimSnapshot changes shape, the C fast paths must be re-verified (they turn off)."""
    assert c_codec._fast_snapshots is True
    assert c_codec._fast_snapshot_fields is True


# --------------------------------------------------------------------------
# new_jobs (the claimer's dispatch)


def _slots_of(job: Job[Any]) -> dict[str, Any]:
    return {name: getattr(job, name) for name in Job.__slots__ if hasattr(job, name)}


class _Holder:
    job: Any = None


class _SnapshotLike:
    """Not a ClaimSnapshot: new_jobs must read it by attribute and call Job(...)."""

    def __init__(self, snap: ClaimSnapshot) -> None:
        self.__dict__.update({f: getattr(snap, f) for f in ClaimSnapshot.__struct_fields__})


def test_new_jobs_match_the_constructor_slot_by_slot(codec: types.ModuleType) -> None:
    class Args(msgspec.Struct):
        n: int

    runtime = object()
    snaps = [snapshot(i, kind="typed" if i % 3 else "plain", args=b'{"n": %d}' % i) for i in range(40)]
    types_by_kind: dict[str, type | None] = {"typed": Args, "plain": None}
    got = codec.new_jobs(snaps, types_by_kind, runtime)
    want = [Job(s, types_by_kind.get(s.kind), runtime) for s in snaps]
    assert [type(j) for j in got] == [Job] * 40
    for g, w in zip(got, want, strict=True):
        assert _slots_of(g) == _slots_of(w)
        assert g.snapshot is w.snapshot and g.key == (w.snapshot.job_id, w.snapshot.run_lease)
        assert not hasattr(g, "finished_at") and not hasattr(g, "_stale") and not hasattr(g, "_task")
    assert got[1].args == Args(1) and got[0].args == {"n": 0}  # the args type per kind, decoded lazily
    got[0].started_at = 1.5  # an ordinary, writable Job
    got[0].finished_at = 2.0
    assert got[0].finished_at - got[0].started_at == 0.5
    unknown = codec.new_jobs([snapshot(kind="other")], types_by_kind, None)[0]
    assert unknown._args_type is None and unknown._runtime is None
    assert codec.new_jobs(iter(snaps[:2]), types_by_kind, runtime)[1].snapshot is snaps[1]
    assert codec.new_jobs([], types_by_kind, runtime) == []
    (like,) = codec.new_jobs([_SnapshotLike(snaps[4])], types_by_kind, runtime)
    assert like.key == (snaps[4].job_id, snaps[4].run_lease) and like._args_type is Args


def test_new_jobs_references_and_collection(codec: types.ModuleType) -> None:
    runtime = object()
    snap = snapshot(7)
    before_rt, before_snap = sys.getrefcount(runtime), sys.getrefcount(snap)
    jobs = codec.new_jobs([snap] * 5, {}, runtime)
    assert sys.getrefcount(runtime) == before_rt + 5 and sys.getrefcount(snap) == before_snap + 5
    assert all(gc.is_tracked(j) for j in jobs)  # a cycle through a Job (job -> runtime -> job) is collectable
    holder = _Holder()
    holder.job = jobs[0]
    jobs[0]._runtime = holder  # noqa: SLF001
    ref = weakref.ref(holder)
    del jobs, holder
    gc.collect()
    assert ref() is None
    assert sys.getrefcount(runtime) == before_rt and sys.getrefcount(snap) == before_snap


def test_c_uses_fast_job_layout(c_codec: types.ModuleType) -> None:
    """If Job changes shape or its __init__ stores anything else, the probe turns the C path off."""
    assert c_codec._fast_jobs is True


# --------------------------------------------------------------------------
# flush_tally (the claimer's pass over a completion flush)


class _JobLike:
    """Not a Job: flush_tally must read it by attribute (the C path's getattr fallback)."""

    def __init__(self, job: Job[Any]) -> None:
        self.key, self.snapshot, self.started_at = job.key, job.snapshot, job.started_at
        self.id, self.run_lease, self.kind = job.id, job.run_lease, job.kind
        if hasattr(job, "finished_at"):
            self.finished_at = job.finished_at


def _tally_by_hand(pairs: list[tuple[Any, Any]], stale: set[tuple[int, int]], offset: float,
                   committed: float) -> tuple[Any, ...]:
    """What a flush counts, written out case by case (independent of both implementations)."""
    keys = [j.key for j, _ in pairs]
    completed = 0
    other: dict[str, int] = {}
    e2e, pickup, handler, closed = [], [], [], []
    for job, out in pairs:
        if job.started_at and getattr(job, "finished_at", 0.0):
            handler.append(job.finished_at - job.started_at)
        if out is Unwritten.PARKED:
            continue
        if out is Unwritten.STALE or job.key in stale:
            what = "stale"
        elif out is COMPLETED:
            what = "completed"
        else:
            what = out.code.closed_as
        if out is COMPLETED and what == "completed":  # the shared record; an equal Outcome counts as "other"
            completed += 1
        else:
            other[what] = other.get(what, 0) + 1
        closed.append(AttemptClosed(job.id, job.run_lease, job.kind, what, job.started_at or 0.0, committed))
        if what != "stale":
            created = job.snapshot.created_at.timestamp() - offset
            e2e.append(committed - created)
            if job.started_at:
                pickup.append(job.started_at - created)
    return keys, completed, other, e2e, pickup, handler, closed


def _flush_pairs() -> list[tuple[Any, Any]]:
    t0 = NOW.timestamp()
    pairs: list[tuple[Any, Any]] = []
    outs: list[Any] = [COMPLETED, COMPLETED, Outcome(CloseCode.RETRY, error="x"), Unwritten.PARKED,
                       Unwritten.STALE, Outcome(CloseCode.SNOOZE, 0.0), Outcome(CloseCode.COMPLETE),
                       Outcome(CloseCode.CANCEL), Outcome(CloseCode.FAIL, error="y")]
    for i in range(60):
        # runs of equal created_at (jobs enqueued together), then a new one every 7 jobs
        snap = snapshot(i, created_at=NOW + dt.timedelta(seconds=i // 7), kind=f"k{i % 3}")
        (job,) = new_jobs_py([snap])
        if i % 5:  # some never started
            job.started_at = t0 + 10.0 + i
            if i % 4:  # some started and not returned
                job.finished_at = t0 + 10.5 + i * 1.25
        pairs.append((job if i % 11 else _JobLike(job), outs[i % len(outs)]))
    return pairs


def new_jobs_py(snaps: list[ClaimSnapshot]) -> list[Job[Any]]:
    return [Job(s, None, None) for s in snaps]


def test_flush_tally_counts_and_samples_every_case(codec: types.ModuleType) -> None:
    pairs = _flush_pairs()
    stale = {pairs[0][0].key, pairs[2][0].key, pairs[10][0].key}  # a completed, a retried one and a parked one
    offset, committed = -3.25, NOW.timestamp() + 100.0
    closed: list[AttemptClosed] = []
    got = codec.flush_tally(pairs, stale, offset, committed, closed)
    want = _tally_by_hand(pairs, stale, offset, committed)
    assert got == want[:6] and closed == want[6]
    keys, completed, other, e2e, pickup, handler = got
    assert completed > 0 and set(other) == {"stale", "retried", "snoozed", "completed", "cancelled", "failed"}
    assert len(e2e) > len(pickup) > 0 and handler and len(keys) == len(pairs)
    # no listeners: nothing built for them, the same counts
    assert codec.flush_tally(pairs, stale, offset, committed, None) == want[:6]
    assert codec.flush_tally(iter(pairs), set(), 0.0, committed, None) == _tally_by_hand(pairs, set(), 0.0,
                                                                                          committed)[:6]
    assert codec.flush_tally([], set(), 0.0, 0.0, None) == ([], 0, {}, [], [], [])


def test_flush_tally_c_matches_the_twin_and_raises_alike(c_codec: types.ModuleType) -> None:
    pairs = _flush_pairs()
    stale = {pairs[5][0].key}
    assert c_codec.flush_tally(pairs, stale, 1.5, 2e9, []) == pycodec.flush_tally(pairs, stale, 1.5, 2e9, [])
    for bad in ([(1, 2)], [(pairs[0][0],)], [object()]):
        assert outcome(c_codec.flush_tally, bad, set(), 0.0, 0.0, None)[:2] == \
            outcome(pycodec.flush_tally, bad, set(), 0.0, 0.0, None)[:2]


def test_raw_jsonb_drops_the_version_byte(codec: types.ModuleType) -> None:
    text = '{"a": "ünï ✓", "b": [1, 2]}'.encode()
    for data in (b"\x01" + text, memoryview(b"\x01" + text), bytearray(b"\x01" + text)):
        got = codec.raw_jsonb(data)
        assert type(got) is bytes and got == text
    assert codec.raw_jsonb(b"\x01") == b"" and codec.raw_jsonb(b"") == b""
    assert codec.raw_jsonb(memoryview(b"\x01x" * 3)[2:]) == b"x\x01x"  # a view into a bigger buffer
    with pytest.raises(TypeError):
        codec.raw_jsonb("not a buffer")


def test_claim_summary_counts_receipts_and_kinds(codec: types.ModuleType) -> None:
    from collections import Counter

    # runs of a receipt, a receipt that comes back after another (9001 ... 9000), kinds as equal
    # strings that are different objects, and an object that is not a ClaimSnapshot
    cids = [9000] * 5 + [9001] * 3 + [9000] * 2 + [9002] + [9001]
    snaps: list[Any] = [snapshot(i, claim_id=c, kind="".join(["k", str(i % 3)])) for i, c in enumerate(cids)]
    snaps.append(_SnapshotLike(snapshot(99, claim_id=9003, kind="k0")))
    counts, kinds = codec.claim_summary(snaps)
    assert type(counts) is dict and counts == Counter(s.claim_id for s in snaps) == {9000: 7, 9001: 4, 9002: 1,
                                                                                     9003: 1}
    assert list(counts) == [9000, 9001, 9002, 9003]  # first-seen order, as the batcher got it before
    assert kinds == {"k0", "k1", "k2"}
    assert codec.claim_summary(iter(snaps[:3])) == ({9000: 3}, {"k0", "k1", "k2"})
    assert codec.claim_summary([]) == ({}, set())


# --------------------------------------------------------------------------
# implementation selection


def _impl_run(
    impl: str | None, code: str = "import awa_fast._impl as i; print(i.IMPL)"
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("AWA_FAST_IMPL", None)
    if impl is not None:
        env["AWA_FAST_IMPL"] = impl
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_impl_python() -> None:
    res = _impl_run("python")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "python"


def test_impl_c() -> None:
    res = _impl_run("c")
    if ccodec is None:
        assert res.returncode != 0 and "ImplementationUnavailable" in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "c"


def test_impl_default_prefers_c() -> None:
    res = _impl_run(None, "import awa_fast; print(awa_fast.__impl__)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ("c" if ccodec is not None else "python")


def test_impl_bogus_is_config_error() -> None:
    res = _impl_run("bogus")
    assert res.returncode != 0
    assert "awa_fast.errors.ConfigError" in res.stderr and "'bogus'" in res.stderr


_HIDE_C = "import sys; sys.modules['awa_fast._codec'] = None; "


def test_impl_c_missing_raises() -> None:
    res = _impl_run("c", _HIDE_C + "import awa_fast._impl")
    assert res.returncode != 0
    assert "awa_fast.errors.ImplementationUnavailable" in res.stderr
    assert "C compiler" in res.stderr


def test_impl_default_falls_back_with_one_warning() -> None:
    res = _impl_run(
        None, _HIDE_C + "import awa_fast._impl as i; import awa_fast; print(i.IMPL, awa_fast.__impl__)"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "python python"
    assert res.stderr.count("pure-Python implementation") == 1


# --------------------------------------------------------------------------
# PostgreSQL accepts the streams (integration: needs the pg_dsn fixture)

_READY_COLS = (
    "ready_slot int2, lane_id int4, lane_seq int8, job_id int8, kind text, args jsonb, "
    "metadata jsonb, attempt int2, max_attempts int2, lease_base int4"
)
_DONE_COLS = (
    "ready_slot int2, job_id int8, lane_id int4, lane_seq int8, run_lease int4, attempt int2, "
    "state int2, queue text, kind text"
)
_CLOSURE_COLS = "claim_slot int2, claim_id int8, job_id int8, run_lease int4, outcome int2"


def _names(cols: str) -> str:
    return ", ".join(c.split()[0] for c in cols.split(", "))


def _copy_back(cur: Any, table: str, cols: str, buf: bytes) -> list[tuple[Any, ...]]:
    cur.execute(f"CREATE TEMP TABLE {table} ({cols})")
    with cur.copy(f"COPY {table} ({_names(cols)}) FROM STDIN (FORMAT binary)") as cp:
        cp.write(buf)
    cur.execute(f"SELECT {_names(cols)} FROM {table} ORDER BY 1, 2, 3")
    return list(cur.fetchall())


@pytest.mark.integration
def test_postgres_accepts_streams(codec: types.ModuleType, pg_dsn: str) -> None:
    import psycopg

    payloads = [
        json.dumps({"i": i, "s": "\u00e9\U0001f600", "l": [1, 2.5, None]}).encode() for i in range(20)
    ]
    ready = codec.encode_ready_rows(2, 5, 1000, "emails.send", payloads, b'{"trace": "x"}', 1, 25)
    snaps = [snapshot(i, queue="q\u00e9", kind="k:1", ready_slot=i % 4) for i in range(30)]
    with psycopg.connect(pg_dsn) as conn, conn.cursor() as cur:
        got = _copy_back(cur, "ready_t", _READY_COLS, ready)
        assert got == [
            (
                2,
                5,
                1000 + i,
                (5 << 40) | (1000 + i),
                "emails.send",
                json.loads(payloads[i]),
                {"trace": "x"},
                1,
                25,
                0,
            )
            for i in range(20)
        ]
        null_meta = codec.encode_ready_rows(0, 1, 1, "k", [b"[]"], None, 0, 1)
        assert _copy_back(cur, "ready_null_t", _READY_COLS, null_meta)[0][5:7] == ([], None)

        got = _copy_back(cur, "done_t", _DONE_COLS, codec.encode_done_rows(snaps))
        want = sorted(
            (s.ready_slot, s.job_id, s.lane_id, s.lane_seq, s.run_lease, s.attempt, 1, s.queue, s.kind)
            for s in snaps
        )
        assert got == want

        got = _copy_back(cur, "closure_t", _CLOSURE_COLS, codec.encode_closure_rows(snaps, CLOSURE_COMPLETED))
        assert got == sorted(
            (s.claim_slot, s.claim_id, s.job_id, s.run_lease, CLOSURE_COMPLETED) for s in snaps
        )
        conn.rollback()
