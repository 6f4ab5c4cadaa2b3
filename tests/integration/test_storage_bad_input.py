"""Bad input gets a typed error before anything is written, and the caller's
transaction stays usable (RELIABILITY.md, "Bad input").

Every case runs inside a caller's open transaction that already wrote a row
of its own: the bad call raises the awa_fast.errors type, nothing changed in
any table of the schema, and a following good enqueue in the same
transaction commits together with the caller's row.

Nothing here writes on a bad call, so the module shares one migrated schema
(each test uses its own queue).
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from awa_fast.client import Client
from awa_fast.errors import AwaFastError, InvalidName, OutOfRange, PayloadError
from awa_fast.storage import Storage
from awa_fast.storage.migrate import RingSizes, migrate
from tests.fixtures.database import connect
from tests.integration.storage_helpers import row_counts

HOSTILE = 'x"; drop table y; --'
_queues = itertools.count()


@pytest.fixture(scope="module")
def bschema(pg_dsn: str) -> Iterator[str]:
    name = f"t_bad_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    migrate(pg_dsn, name, RingSizes(ready=4, claim=4, lease=4))
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{name}".caller_orders (id int PRIMARY KEY, note text)')
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                  "WHERE pid <> pg_backend_pid() AND application_name LIKE %s", (f"%{name}%",))
        c.execute(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture(scope="module")
def bconn(pg_dsn: str, bschema: str) -> Iterator[psycopg.Connection]:
    c = connect(pg_dsn, bschema, tag="observer")
    yield c
    c.close()


@pytest.fixture
def queue() -> str:
    return f"bad{next(_queues)}"


def rejected(pg_dsn: str, schema: str, conn: psycopg.Connection, queue: str,
             call: Callable[[Client, psycopg.Connection], Any], error: type[AwaFastError]) -> AwaFastError:
    """Run ``call`` in a caller's transaction; check the typed error, no writes, usable transaction."""
    cli = Client(None, schema)
    order = abs(hash(queue)) % 1_000_000_000
    with connect(pg_dsn, schema, autocommit=False, tag="caller") as p:
        p.execute(f'INSERT INTO "{schema}".caller_orders VALUES (%s, %s)', (order, "caller's own row"))
        before = row_counts(p, schema)
        with pytest.raises(error) as info:
            call(cli, p)
        assert isinstance(info.value, AwaFastError)
        assert "nothing was enqueued" in str(info.value) or not isinstance(info.value, PayloadError)
        # the transaction is still open and clean, and nothing of the call is left (a streamed bulk
        # enqueue may have sent rows first: its savepoint took them back)
        assert p.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert row_counts(p, schema) == before
        good = cli.enqueue("good.job", {"ok": True}, queue=queue, conn=p)
        p.commit()
    snaps = Storage(schema).lane_claim(conn, queue, 10)
    assert [s.job_id for s in snaps] == [good]
    assert conn.execute(f'SELECT note FROM "{schema}".caller_orders WHERE id = %s', (order,)).fetchone() \
        == ("caller's own row",)
    return info.value


def deep(levels: int) -> Any:
    out: Any = 1
    for _ in range(levels):
        out = {"a": out}
    return out


BAD_PAYLOADS = {
    "nul_value": {"s": "a\x00b"},
    "nul_key": {"a\x00": 1},
    "nul_in_list": ["ok", ["x\x00"]],
    "lone_surrogate_value": {"s": "\ud800"},
    "lone_surrogate_key": {"\udfff": 1},
    "nan": {"x": math.nan},
    "inf": {"x": math.inf},
    "minus_inf": [-math.inf],
    "too_deep": deep(33),
    "too_big": {"blob": "x" * (1 << 20)},
    "int_over_64_bits": {"n": 2**64},
    "non_str_key": {1: "one"},
    "bytes": {"b": b"raw"},
}


@pytest.mark.parametrize("where", ["args", "metadata"])
@pytest.mark.parametrize("name", list(BAD_PAYLOADS))
def test_bad_payload_is_rejected_before_writing(pg_dsn, bschema, bconn, queue, name, where):
    payload = BAD_PAYLOADS[name]
    if where == "args":
        call = lambda cli, p: cli.enqueue("some.kind", payload, queue=queue, conn=p)  # noqa: E731
    else:
        call = lambda cli, p: cli.enqueue("some.kind", {"fine": 1}, metadata=payload, queue=queue, conn=p)  # noqa: E731
    err = rejected(pg_dsn, bschema, bconn, queue, call, PayloadError)
    assert isinstance(err, ValueError)


def test_payload_limits_are_exact(pg_dsn, bschema, bconn, queue):
    cli = Client(None, bschema)
    ok_depth = cli.enqueue("k", deep(31), queue=queue, conn=bconn)  # 31 dicts + the value: within 32
    big = {"b": "x" * ((1 << 20) - 10)}  # {"b":"..."} is exactly 1 MiB of JSON
    ok_big = cli.enqueue("k", big, queue=queue, conn=bconn)
    assert [s.job_id for s in Storage(bschema).lane_claim(bconn, queue, 10)] == [ok_depth, ok_big]


@pytest.mark.parametrize("bad", ["a\x00b", "\ud800", "k\udcff", HOSTILE, "", " ", "-lead", "a" * 101, "tab\t",
                                 "ünï", None, 5])
def test_bad_kind_is_rejected(pg_dsn, bschema, bconn, queue, bad):
    err = rejected(pg_dsn, bschema, bconn, queue, lambda cli, p: cli.enqueue(bad, {}, queue=queue, conn=p),
                   InvalidName)
    assert isinstance(err, InvalidName) and err.what == "kind"


@pytest.mark.parametrize("bad", ["a\x00b", "\ud800", HOSTILE, "", "a" * 101, "q q", "q'", 7])
def test_bad_queue_is_rejected(pg_dsn, bschema, bconn, queue, bad):
    err = rejected(pg_dsn, bschema, bconn, queue, lambda cli, p: cli.enqueue("k", {}, queue=bad, conn=p),
                   InvalidName)
    assert isinstance(err, InvalidName) and err.what == "queue"


def test_unknown_but_valid_names_are_stored_verbatim(pg_dsn, bschema, bconn):
    cli = Client(None, bschema)
    name = "a.b:c-d_E9"
    job = cli.enqueue("never.registered-kind:v2", {"x": 1}, queue=name, conn=bconn)
    [snap] = Storage(bschema).lane_claim(bconn, name, 10)
    assert (snap.job_id, snap.queue, snap.kind) == (job, name, "never.registered-kind:v2")


@pytest.mark.parametrize("bad", [0, 5, -1, True, False, 1.5, "1", 2**70])
def test_bad_priority_is_rejected(pg_dsn, bschema, bconn, queue, bad):
    err = rejected(pg_dsn, bschema, bconn, queue,
                   lambda cli, p: cli.enqueue("k", {}, queue=queue, priority=bad, conn=p), OutOfRange)
    assert err.what == "priority"


@pytest.mark.parametrize("bad", [0, 1001, -1, True, 2.0, "3"])
def test_bad_max_attempts_is_rejected(pg_dsn, bschema, bconn, queue, bad):
    err = rejected(pg_dsn, bschema, bconn, queue,
                   lambda cli, p: cli.enqueue("k", {}, queue=queue, max_attempts=bad, conn=p), OutOfRange)
    assert err.what == "max_attempts"


@pytest.mark.parametrize("bad", [-1, -0.001, math.nan, math.inf, -math.inf, 1e12, 10 * 365 * 86400.0 + 1, True, "5"])
def test_bad_delay_is_rejected(pg_dsn, bschema, bconn, queue, bad):
    err = rejected(pg_dsn, bschema, bconn, queue,
                   lambda cli, p: cli.enqueue("k", {}, queue=queue, delay=bad, conn=p), OutOfRange)
    assert err.what == "delay"


def test_naive_run_at_is_rejected(pg_dsn, bschema, bconn, queue):
    naive = dt.datetime.now() + dt.timedelta(hours=1)
    rejected(pg_dsn, bschema, bconn, queue,
             lambda cli, p: cli.enqueue("k", {}, queue=queue, run_at=naive, conn=p), PayloadError)


def test_run_at_and_delay_together_are_rejected(pg_dsn, bschema, bconn, queue):
    aware = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    rejected(pg_dsn, bschema, bconn, queue,
             lambda cli, p: cli.enqueue("k", {}, queue=queue, run_at=aware, delay=5, conn=p), PayloadError)


def test_enqueue_many_with_one_bad_payload_writes_nothing(pg_dsn, bschema, bconn, queue):
    rows = [{"i": i} for i in range(2000)]
    rows[1500] = {"i": math.nan}
    rejected(pg_dsn, bschema, bconn, queue,
             lambda cli, p: cli.enqueue_many("k", rows, queue=queue, conn=p), PayloadError)


@pytest.mark.parametrize("kw,error", [
    ({"kind": HOSTILE}, InvalidName), ({"queue": HOSTILE}, InvalidName), ({"priority": 0}, OutOfRange),
    ({"max_attempts": 1001}, OutOfRange), ({"metadata": {"m": "\x00"}}, PayloadError),
])
def test_enqueue_many_bad_options_write_nothing(pg_dsn, bschema, bconn, queue, kw, error):
    kw = dict(kw)
    kind = kw.pop("kind", "k")
    kw.setdefault("queue", queue)
    rejected(pg_dsn, bschema, bconn, queue,
             lambda cli, p: cli.enqueue_many(kind, [{"i": 1}, {"i": 2}], conn=p, **kw), error)


@pytest.mark.parametrize("bad", [HOSTILE, "Public", "1abc", "a-b", "a" * 64, "", "awa fast", "x;y", None])
def test_hostile_schema_names_are_refused(pg_dsn, bad):
    with pytest.raises(InvalidName):
        Storage(bad)
    with pytest.raises(InvalidName):
        Client(None, bad)
    with pytest.raises(InvalidName):
        migrate(pg_dsn, bad)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        if isinstance(bad, str):
            assert c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (bad,)).fetchone() == (0,)
        assert c.execute("SELECT to_regclass('y')").fetchone() == (None,)


def test_hostile_default_queue_is_refused():
    with pytest.raises(InvalidName):
        Client(None, "awa_fast", default_queue=HOSTILE)
