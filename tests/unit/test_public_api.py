"""The public API's pure parts: typed payload encoding, the DSN and schema rule, validation.

No database: these run under both implementations of the accelerated
codec (``AWA_FAST_IMPL=c`` and ``python``), since ``encode_payload``
checks through :func:`awa_fast._impl.check_payload`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import decimal
import enum
import math
import uuid

import msgspec
import orjson
import pytest

import awa_fast
from awa_fast.app import App, dsn_from_environment, resolve_schema
from awa_fast.cli import build_parser, supervise_target
from awa_fast.client import encode_payload
from awa_fast.errors import ConfigError, OutOfRange, PayloadError

pytestmark = pytest.mark.accelerated


class Point(msgspec.Struct):
    x: float
    y: float
    label: str = ""


@dataclasses.dataclass
class Order:
    id: uuid.UUID
    at: dt.datetime
    total: decimal.Decimal
    points: list[Point]


class Color(enum.Enum):
    RED = "red"


def decoded(obj: object) -> object:
    return orjson.loads(bytes(encode_payload(obj)))


def test_typed_values_encode_as_msgspec_would():
    at = dt.datetime(2026, 5, 6, 7, 8, 9, 123000, tzinfo=dt.UTC)
    order = Order(uuid.UUID(int=1), at, decimal.Decimal("9.99"), [Point(1.5, 2.0)])
    assert decoded(order) == msgspec.json.decode(msgspec.json.encode(order))
    assert decoded(order) == {"id": "00000000-0000-0000-0000-000000000001", "at": "2026-05-06T07:08:09.123000Z",
                              "total": "9.99", "points": [{"x": 1.5, "y": 2.0, "label": ""}]}
    assert decoded({"when": dt.date(2026, 1, 2), "c": Color.RED, "s": {1}}) == \
        {"when": "2026-01-02", "c": "red", "s": [1]}
    assert decoded({"plain": [1, "two", None, True, 2.5]}) == {"plain": [1, "two", None, True, 2.5]}
    # a typed payload decodes back into its type on the worker side
    assert msgspec.json.decode(encode_payload(order), type=Order) == order


BAD = {
    "nan in a struct": Point(math.nan, 1.0),
    "inf in a dataclass": Order(uuid.UUID(int=1), dt.datetime(2026, 1, 1), decimal.Decimal(1), [Point(math.inf, 0)]),
    "nul in a struct": Point(1, 2, "a\x00b"),
    "surrogate in a struct": Point(1, 2, "\udc80"),
    "nul in a nested dataclass key": {"k": {"a\x00": Point(1, 2)}},
    "bytes stay refused": {"raw": b"x", "p": Point(1, 2)},
    "int over 64 bits next to a struct": [Point(1, 2), 2**70],
    "non-str key next to a struct": {1: Point(1, 2)},
    "unsupported object": {"o": object(), "p": Point(1, 2)},
    "too big": Point(1, 2, "x" * (1 << 20)),
}


@pytest.mark.parametrize("name", list(BAD))
def test_typed_values_get_every_safety_check(name):
    with pytest.raises(PayloadError):
        encode_payload(BAD[name])


def test_depth_is_checked_after_conversion():
    deep: object = Point(1, 2)
    for _ in range(31):
        deep = {"a": deep}
    encode_payload(deep)  # 31 dicts + the struct's dict: 32
    with pytest.raises(PayloadError, match="max_depth"):
        encode_payload({"a": deep})


def test_dsn_and_schema_rule(monkeypatch):
    for var in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA"):
        monkeypatch.delenv(var, raising=False)
    assert dsn_from_environment(None) == (None, "embedded")
    monkeypatch.setenv("DATABASE_URL", "postgresql://db/url")
    assert dsn_from_environment(None) == ("postgresql://db/url", "DATABASE_URL")
    monkeypatch.setenv("AWA_FAST_DSN", "postgresql://db/awa")
    assert dsn_from_environment(None) == ("postgresql://db/awa", "AWA_FAST_DSN")
    assert dsn_from_environment("postgresql://db/explicit") == ("postgresql://db/explicit", "argument")
    with pytest.raises(ConfigError, match="invalid DSN"):
        dsn_from_environment("not a dsn")
    assert resolve_schema(None) == "awa_fast"
    monkeypatch.setenv("AWA_FAST_SCHEMA", "from_env")
    assert resolve_schema(None) == "from_env" and resolve_schema("given") == "given"
    assert App().storage.schema == "from_env" and App(schema="given").storage.schema == "given"


def _supervise_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["supervise", "m:app", *argv])


def test_supervise_follows_the_same_rule_as_app(monkeypatch):
    for var in ("AWA_FAST_DSN", "DATABASE_URL", "AWA_FAST_SCHEMA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DATABASE_URL", "postgresql://db/url")
    monkeypatch.setenv("AWA_FAST_SCHEMA", "env_schema")
    plain = App()
    assert supervise_target(_supervise_args(), plain) == ("postgresql://db/url", "DATABASE_URL", "env_schema")
    assert plain.resolve_dsn() == "postgresql://db/url"   # the producer side agrees
    pinned = App("postgresql://db/app", "app_schema")
    assert supervise_target(_supervise_args(), pinned) == ("postgresql://db/app", "m:app's dsn", "app_schema")
    assert supervise_target(_supervise_args("--dsn", "postgresql://db/flag", "--schema", "flag_schema"), pinned) \
        == ("postgresql://db/flag", "--dsn", "flag_schema")


def test_argument_validation_happens_before_any_connection():
    app = App("postgresql://nobody@127.0.0.1:1/none")
    for call in (lambda: app.get_job(-1), lambda: app.get_job(2**63), lambda: app.cancel(True),
                 lambda: app.list_jobs(limit=0), lambda: app.list_jobs(limit=10_001),
                 lambda: app.list_jobs(before_id=0), lambda: app.dlq_list(limit=-1),
                 lambda: app.wait(1, timeout=math.nan), lambda: app.dlq_purge([0]),
                 lambda: app.configure_queue("q", enqueue_shards=0),
                 lambda: app.enqueue_many("k", [{}], queue="q", chunk=0)):
        with pytest.raises(OutOfRange):
            call()
    for call in (lambda: app.list_jobs(state="done"), lambda: app.dlq_retry(), lambda: app.dlq_purge(),
                 lambda: app.configure_queue("q", dlq=1), lambda: app.enqueue("unregistered", {}),
                 lambda: app.list_jobs(queue="bad queue")):
        with pytest.raises(ConfigError):
            call()
    assert app.complete_callback("not-a-uuid") is False   # never even connects
    assert isinstance(awa_fast.Job[Point], object)
