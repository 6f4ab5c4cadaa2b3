"""``dump_payloads`` (both codecs) and ``client.encode_payloads`` built on it.

The bulk enqueue encodes its payloads through one accelerated loop instead of
one ``encode_payload`` call per payload. The contract: exactly what the
per-payload calls return or raise, for every input; the loop only decides
which items it may take itself and hands every other one back.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import types
from collections import OrderedDict
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import awa_fast._pycodec as pycodec
from awa_fast.client import MAX_DEPTH, encode_payload, encode_payloads
from awa_fast.errors import PayloadError
from awa_fast.storage import RawJson

try:
    import awa_fast._codec as ccodec
except ImportError:  # pragma: no cover - depends on the install
    ccodec = None  # type: ignore[assignment]


@pytest.fixture(scope="module", params=["c", "python"])
def codec(request: pytest.FixtureRequest) -> types.ModuleType:
    if request.param == "c":
        if ccodec is None:
            pytest.fail("the C extension awa_fast._codec is not built (python tools/dev.py setup)")
        return ccodec
    return pycodec


def test_takes_plain_dicts_and_lists_and_stops_at_the_first_other_item(codec: types.ModuleType) -> None:
    objs: list[Any] = [{"a": 1}, [1, "x"], {"b": [None, True, 1.5]}, None, {"c": 2}]
    out: list[bytes] = []
    assert codec.dump_payloads(objs, 0, out, 32, 1 << 20, orjson.dumps) == 3
    assert out == [b'{"a":1}', b'[1,"x"]', b'{"b":[null,true,1.5]}']
    assert all(type(b) is bytes for b in out)
    assert codec.dump_payloads(objs, 4, out, 32, 1 << 20, orjson.dumps) == 5
    assert out[-1] == b'{"c":2}'
    assert codec.dump_payloads(objs, 5, out, 32, 1 << 20, orjson.dumps) == 5
    assert codec.dump_payloads([], 0, out, 32, 1 << 20, orjson.dumps) == 0


@pytest.mark.parametrize("bad", [
    {"x": float("nan")}, {"x": "a\x00"}, {"x": "\ud800"}, [[[1]]], {"x": dt.date(2026, 1, 1)},
    {1: 2}, OrderedDict(a=1), ("tuple",), "str", 5,
])
def test_declines_what_it_must_not_take(codec: types.ModuleType, bad: Any) -> None:
    out: list[bytes] = []
    assert codec.dump_payloads([{"ok": 1}, bad, {"ok": 2}], 0, out, 2, 1 << 20, orjson.dumps) == 1
    assert out == [b'{"ok":1}']


def test_declines_oversized_non_bytes_and_failing_dumps(codec: types.ModuleType) -> None:
    out: list[bytes] = []
    assert codec.dump_payloads([{"a": 1}, {"a": "x" * 20}], 0, out, 32, 16, orjson.dumps) == 1
    assert codec.dump_payloads([{"a": 1}], 0, out, 32, 16, lambda o: "not bytes") == 0

    def boom(o: Any) -> bytes:
        raise RuntimeError("no")

    assert codec.dump_payloads([{"a": 1}], 0, out, 32, 16, boom) == 0
    assert out == [b'{"a":1}']


def test_a_dumps_that_shrinks_the_list_is_safe(codec: types.ModuleType) -> None:
    objs: list[Any] = [{"a": 1}, {"a": 2}, {"a": 3}]

    def shrinking(o: Any) -> bytes:
        objs.clear()
        return b"{}"

    out: list[bytes] = []
    assert codec.dump_payloads(objs, 0, out, 32, 100, shrinking) == 1
    assert out == [b"{}"]


def test_argument_errors(codec: types.ModuleType) -> None:
    with pytest.raises(TypeError, match="objs must be a list, not tuple"):
        codec.dump_payloads(({},), 0, [], 32, 10, orjson.dumps)
    with pytest.raises(TypeError, match="out must be a list, not tuple"):
        codec.dump_payloads([{}], 0, (), 32, 10, orjson.dumps)
    with pytest.raises(ValueError, match="max_depth=513 must be in 0..512"):
        codec.dump_payloads([{}], 0, [], 513, 10, orjson.dumps)
    with pytest.raises(ValueError, match="start=-1 must be >= 0"):
        codec.dump_payloads([{}], -1, [], 32, 10, orjson.dumps)


@dataclasses.dataclass
class _Point:
    x: int
    at: dt.datetime


_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=6),
    st.sampled_from(["\x00", "a\ud800", b"raw", dt.date(2026, 12, 1), _Point(1, dt.datetime(2026, 12, 1))]),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=2).map(tuple),
                            st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 2)), inner, max_size=3)),
    max_leaves=12,
)


def _per_item(objs: list[Any], limit: int) -> tuple[str, Any]:
    try:
        return "ok", [encode_payload({} if o is None else o, "args", limit) for o in objs]
    except PayloadError as exc:
        return "err", (str(exc), exc.path)


@settings(max_examples=300, deadline=None)
@given(objs=st.lists(_value, max_size=6), limit=st.sampled_from([8, 64, 1 << 20]))
def test_encode_payloads_is_encode_payload_of_each_item(objs: list[Any], limit: int) -> None:
    want = _per_item(objs, limit)
    try:
        got: tuple[str, Any] = "ok", encode_payloads(objs, "args", limit)
    except PayloadError as exc:
        got = "err", (str(exc), exc.path)
    assert got == want
    if got[0] == "ok":
        assert all(isinstance(b, bytes) for b in got[1])


def test_encode_payloads_takes_iterables_and_keeps_the_depth_limit() -> None:
    gen = ({"n": i} for i in range(3))
    assert encode_payloads(gen) == [b'{"n":0}', b'{"n":1}', b'{"n":2}']
    assert MAX_DEPTH == 32
    with pytest.raises(PayloadError, match="nesting deeper than max_depth=32"):
        deep: Any = 1
        for _ in range(33):
            deep = [deep]
        encode_payloads([{"ok": 1}, deep])
    assert encode_payloads([None, {}]) == [RawJson(b"{}"), b"{}"]
