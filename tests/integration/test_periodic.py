"""Periodic jobs (issue 13): cron evaluation, DST, seconds, the fire ledger, sync, CLI, unique fires."""

from __future__ import annotations

import datetime as _dt
import io
import json
import logging
import threading
import time
from contextlib import redirect_stdout

import psycopg
import pytest

from awa_fast import Unique, cron_cli, periodic
from awa_fast.app import App
from awa_fast.errors import ConfigError
from awa_fast.storage import Storage
from awa_fast.storage.schema import render

pytestmark = pytest.mark.integration

Q = "q"
UTC = _dt.UTC


def sql(conn: psycopg.Connection, schema: str, text: str, params: object = None) -> list[tuple]:
    return conn.execute(render(text, schema), params).fetchall()  # type: ignore[arg-type]


def make_app(pg_dsn: str, schema: str) -> App:
    app = App(pg_dsn, schema, default_queue=Q)
    app.periodic_source = "tests.integration.test_periodic:app"  # type: ignore[attr-defined]
    return app


def anchor(conn: psycopg.Connection, schema: str, name: str, at: str) -> None:
    """Move a schedule's anchor (as if it had been declared at ``at``, a SQL expression)."""
    sql(conn, schema, f"UPDATE __SCHEMA__.schedules SET anchor_at = {at} WHERE name = %s RETURNING 1", (name,))


def fires(storage: Storage, conn: psycopg.Connection, name: str) -> list[dict]:
    return storage.schedule_fires_list(conn, name)


def check_chain(rows: list[dict]) -> None:
    """Scheduled fires form one chain: each names the one before it."""
    sched = [r for r in rows if not r["manual"]]
    for before, after in zip(sched, sched[1:]):
        assert after["prev_tick"] == before["tick"], (before, after)


# -- pure evaluation -----------------------------------------------------------------------


def test_dst_both_transitions_in_one_zone():
    berlin = "Europe/Berlin"
    # spring forward 2026-03-29 (02:00 -> 03:00 CEST): 02:30 does not exist, fires once at 03:00
    got = periodic.due_fires("30 2 * * *", berlin, "catch_up", 100, _dt.datetime(2026, 3, 27, 12, tzinfo=UTC), None,
                             _dt.datetime(2026, 3, 31, 12, tzinfo=UTC))
    ticks = [f.tick for f in got]
    assert ticks == [_dt.datetime(2026, 3, 28, 1, 30, tzinfo=UTC), _dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
                     _dt.datetime(2026, 3, 30, 0, 30, tzinfo=UTC), _dt.datetime(2026, 3, 31, 0, 30, tzinfo=UTC)]
    # fall back 2026-10-25 (03:00 CEST -> 02:00 CET): 02:30 happens twice, fires once (the first)
    got = periodic.due_fires("30 2 * * *", berlin, "catch_up", 100, _dt.datetime(2026, 10, 23, 12, tzinfo=UTC),
                             None, _dt.datetime(2026, 10, 27, 12, tzinfo=UTC))
    assert [f.tick for f in got] == [_dt.datetime(2026, 10, 24, 0, 30, tzinfo=UTC),
                                     _dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
                                     _dt.datetime(2026, 10, 26, 1, 30, tzinfo=UTC),
                                     _dt.datetime(2026, 10, 27, 1, 30, tzinfo=UTC)]
    # an hourly schedule fires every real hour: 25 on the fall-back day, 23 on the spring-forward day
    day = periodic.due_fires("@hourly", berlin, "catch_up", 100, _dt.datetime(2026, 10, 24, 21, 59, tzinfo=UTC),
                             None, _dt.datetime(2026, 10, 25, 22, 59, tzinfo=UTC))
    assert len(day) == 25
    day = periodic.due_fires("@hourly", berlin, "catch_up", 100, _dt.datetime(2026, 3, 28, 22, 59, tzinfo=UTC),
                             None, _dt.datetime(2026, 3, 29, 21, 59, tzinfo=UTC))
    assert len(day) == 23
    # coalesce: one fire at the newest due tick, the rest counted
    got = periodic.due_fires("30 2 * * *", berlin, "coalesce", 100, _dt.datetime(2026, 10, 23, 12, tzinfo=UTC),
                             None, _dt.datetime(2026, 10, 27, 12, tzinfo=UTC))
    assert [(f.tick, f.coalesced) for f in got] == [(_dt.datetime(2026, 10, 27, 1, 30, tzinfo=UTC), 3)]


def test_cron_forms_aliases_and_validation():
    assert periodic.normalize_cron("@hourly") == "0 * * * *"
    assert periodic.normalize_cron("  */5   * * * * ") == "*/5 * * * *"
    assert periodic.normalize_cron("*/10 * * * * *") == "*/10 * * * * *"  # seconds first
    for bad in ("", "* * *", "61 * * * *", "@fortnightly", "* * * * * * *"):
        with pytest.raises(ConfigError):
            periodic.normalize_cron(bad)
    with pytest.raises(ConfigError):
        periodic.declare("x", "* * * * *", "k", timezone="Mars/Olympus")
    with pytest.raises(ConfigError):
        periodic.declare("x", "* * * * *", "k", missed="sometimes")
    # catch_up caps at the newest ticks and counts the dropped ones in the first fire
    got = periodic.due_fires("* * * * * *", "UTC", "catch_up", 3, _dt.datetime(2026, 1, 1, tzinfo=UTC), None,
                             _dt.datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC))
    assert [f.tick.second for f in got] == [8, 9, 10] and got[0].coalesced == 7
    assert got[1].prev == got[0].tick


# -- through the database ------------------------------------------------------------------


def test_daily_schedule_across_both_dst_transitions_in_the_database(pg_dsn, schema, storage, conn):
    app = make_app(pg_dsn, schema)
    app.periodic("nightly", "30 2 * * *", "report.build", {"what": "all"}, timezone="Europe/Berlin",
                 missed="catch_up", catch_up_cap=10_000)
    periodic.sync_schedules(conn, storage, app)
    anchor(conn, schema, "nightly", "'2026-03-27 12:00+00'")
    assert periodic.evaluate_due(storage, conn) > 200
    rows = fires(storage, conn, "nightly")
    check_chain(rows)
    by_day: dict[_dt.date, list[_dt.datetime]] = {}
    for r in rows:
        local = r["tick"].astimezone(periodic.zone("Europe/Berlin"))
        by_day.setdefault(local.date(), []).append(r["tick"])
    assert all(len(v) == 1 for v in by_day.values()), "one fire per local day"
    assert by_day[_dt.date(2026, 3, 29)] == [_dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC)]   # 03:00 CEST
    assert by_day[_dt.date(2026, 10, 25)] == [_dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC)]  # the first 02:30
    days = (rows[-1]["tick"].date() - rows[0]["tick"].date()).days + 1
    assert len(rows) == days
    # each fire enqueued one job carrying its tick
    jobs = sql(conn, schema, "SELECT metadata->>'awa.tick' FROM __SCHEMA__.ready_entries WHERE kind = 'report.build'")
    assert len(jobs) == len(rows)
    assert periodic.evaluate_due(storage, conn) == 0  # nothing more is due


def test_six_field_seconds_schedule(pg_dsn, schema, storage, conn):
    app = make_app(pg_dsn, schema)
    app.periodic("every2s", "*/2 * * * * *", "tick.even", missed="catch_up")
    app.periodic("every2s_coalesced", "*/2 * * * * *", "tick.even")
    periodic.sync_schedules(conn, storage, app)
    for name in ("every2s", "every2s_coalesced"):
        anchor(conn, schema, name, "now() - interval '11 seconds'")
    periodic.evaluate_due(storage, conn)
    caught = fires(storage, conn, "every2s")
    assert len(caught) in (5, 6)
    assert all(r["tick"].second % 2 == 0 and r["tick"].microsecond == 0 for r in caught)
    assert [(b["tick"] - a["tick"]).total_seconds() for a, b in zip(caught, caught[1:])] == [2.0] * (len(caught) - 1)
    check_chain(caught)
    coalesced = fires(storage, conn, "every2s_coalesced")
    assert len(coalesced) == 1 and coalesced[0]["coalesced"] == len(caught) - 1
    assert coalesced[0]["tick"] == caught[-1]["tick"]
    # the next even second fires once more, on the database clock
    last = caught[-1]["tick"]
    deadline = time.monotonic() + 10
    while len(fires(storage, conn, "every2s")) == len(caught):
        assert time.monotonic() < deadline
        periodic.evaluate_due(storage, conn)
        time.sleep(0.1)
    new = fires(storage, conn, "every2s")[len(caught):]
    assert [r["tick"] for r in new] == [last + _dt.timedelta(seconds=2)]


def test_two_evaluators_fire_each_tick_exactly_once(pg_dsn, schema, storage):
    conns = [psycopg.connect(pg_dsn, autocommit=True, application_name=f"awa_fast:test:{schema}") for _ in range(3)]
    app = make_app(pg_dsn, schema)
    app.periodic("per_second", "* * * * * *", "tick.each", missed="catch_up")
    app.periodic("per_second_c", "* * * * * *", "tick.coalesced")
    periodic.sync_schedules(conns[0], storage, app)
    outcomes: list[str] = []
    stop = threading.Event()

    def evaluator(c: psycopg.Connection) -> None:
        while not stop.is_set():
            periodic.evaluate_due(storage, c, on_fire=lambda n, f, o, j: outcomes.append(o))

    threads = [threading.Thread(target=evaluator, args=(c,)) for c in conns[:2]]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while min(len(fires(storage, conns[2], n)) for n in ("per_second", "per_second_c")) < 4:
        assert time.monotonic() < deadline, "the evaluators fired fewer than four ticks in 20 s"
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    obs = conns[2]
    for name, kind in (("per_second", "tick.each"), ("per_second_c", "tick.coalesced")):
        rows = fires(storage, obs, name)
        assert len(rows) >= 3
        check_chain(rows)
        ticks = [r["tick"] for r in rows]
        assert len(set(ticks)) == len(ticks)
        # every tick from the first fire to the last is accounted once: fired, or coalesced into the next
        span = int((ticks[-1] - ticks[0]).total_seconds())
        assert sum(1 + r["coalesced"] for r in rows[1:]) == span
        jobs = sql(obs, schema, "SELECT metadata->>'awa.tick' FROM __SCHEMA__.ready_entries WHERE kind = %s", (kind,))
        assert len(jobs) == len(rows) and len(set(jobs)) == len(jobs)
    assert "fired" in outcomes
    for c in conns:
        c.close()


def test_sync_upserts_disables_missing_and_keeps_other_sources(pg_dsn, schema, storage, conn, caplog):
    app = make_app(pg_dsn, schema)
    app.periodic("a", "*/5 * * * *", "k.a")
    app.periodic("b", "@daily", "k.b", {"x": 1}, timezone="America/New_York")
    assert periodic.sync_schedules(conn, storage, app)["created"] == ["a", "b"]
    assert periodic.sync_schedules(conn, storage, app)["unchanged"] == ["a", "b"]
    other = App(pg_dsn, schema, default_queue=Q)
    other.periodic_source = "other:app"  # type: ignore[attr-defined]
    other.periodic("c", "@hourly", "k.c")
    periodic.sync_schedules(conn, storage, other)
    # a redeploy without "b" and with "a" changed
    app2 = make_app(pg_dsn, schema)
    app2.periodic("a", "*/10 * * * *", "k.a")
    with caplog.at_level(logging.WARNING, logger="awa_fast.periodic"):
        out = periodic.sync_schedules(conn, storage, app2)
    assert out["updated"] == ["a"] and out["disabled"] == ["b"]
    assert "schedule b is no longer declared" in caplog.text
    rows = {r["name"]: r for r in storage.schedule_list(conn)[1]}
    assert set(rows) == {"a", "b", "c"}, "nothing is deleted"
    assert rows["a"]["cron"] == "*/10 * * * *" and rows["a"]["enabled"]
    assert not rows["b"]["enabled"] and rows["c"]["enabled"]
    # a disabled schedule never fires
    anchor(conn, schema, "b", "now() - interval '3 days'")
    periodic.evaluate_due(storage, conn)
    assert fires(storage, conn, "b") == []


def test_decorator_form_and_pause_resume_trigger_cli(pg_dsn, schema, storage, conn):
    app = make_app(pg_dsn, schema)

    @app.periodic("*/5 * * * *", name="report")
    @app.job("report.build", queue="reports", priority=1)
    def build(job):  # noqa: ANN001, ANN202
        return None

    assert app.schedules["report"].kind == "report.build"
    periodic.sync_schedules(conn, storage, app)

    def cli(*argv: str) -> tuple[int, str]:
        buf = io.StringIO()
        with redirect_stdout(buf):
            code = cron_cli.main([*argv, "--dsn", pg_dsn, "--schema", schema])
        return code, buf.getvalue()

    code, out = cli("list", "--json")
    assert code == 0
    (row,) = json.loads(out)
    assert (row["name"], row["cron"], row["timezone"], row["paused"], row["queue"]) == \
        ("report", "*/5 * * * *", "UTC", False, "reports")
    assert row["source"] == "tests.integration.test_periodic:app" and row["next_fire"]
    assert cli("pause", "report")[0] == 0
    anchor(conn, schema, "report", "now() - interval '1 hour'")
    periodic.evaluate_due(storage, conn)
    assert fires(storage, conn, "report") == [], "a paused schedule does not fire"
    assert json.loads(cli("list", "--json")[1])[0]["paused"] is True
    assert cli("resume", "report")[0] == 0
    periodic.evaluate_due(storage, conn)
    assert fires(storage, conn, "report") == [], "ticks missed while paused are not fired on resume"
    code, out = cli("trigger", "report", "--json")
    got = json.loads(out)
    assert code == 0 and got["outcome"] == "fired"
    job = storage.job_load(conn, got["job_id"])
    assert job is not None and job["queue"] == "reports" and job["kind"] == "report.build"
    (manual,) = fires(storage, conn, "report")
    assert manual["manual"]
    assert cli("pause", "nope")[0] == 2
    assert cli("trigger", "nope")[0] == 2


def test_unique_periodic_job_does_not_pile_up_while_its_previous_run_is_running(pg_dsn, schema, storage, conn):
    app = make_app(pg_dsn, schema)

    @app.periodic("* * * * * *", name="refresh", missed="catch_up")
    @app.job("cache.refresh", unique=Unique())
    def refresh(job):  # noqa: ANN001, ANN202
        return None

    periodic.sync_schedules(conn, storage, app)
    anchor(conn, schema, "refresh", "now() - interval '5 seconds'")
    periodic.evaluate_due(storage, conn)
    rows = fires(storage, conn, "refresh")
    assert len(rows) >= 4
    first = rows[0]["job_id"]
    assert first is not None and all(r["job_id"] is None and r["held_by"] == first for r in rows[1:])
    (snap,) = storage.lane_claim(conn, Q, 10)  # the first run is now running
    assert snap.job_id == first
    n = len(rows)
    deadline = time.monotonic() + 10
    while len(fires(storage, conn, "refresh")) < n + 2:
        assert time.monotonic() < deadline
        periodic.evaluate_due(storage, conn)
        time.sleep(0.1)
    assert all(r["held_by"] == first for r in fires(storage, conn, "refresh")[n:])
    assert storage.queue_counts_exact(conn)[Q].get("available", 0) == 0, "nothing piled up"
    with conn.transaction():
        storage.receipt_complete(conn, [snap])
    n = len(fires(storage, conn, "refresh"))
    while len(fires(storage, conn, "refresh")) == n:
        assert time.monotonic() < deadline + 5
        periodic.evaluate_due(storage, conn)
        time.sleep(0.1)
    new = fires(storage, conn, "refresh")[n]
    assert new["job_id"] is not None and new["job_id"] != first, "released once the previous run completed"


def test_fire_ledger_prune_keeps_the_newest_fire(pg_dsn, schema, storage, conn):
    app = make_app(pg_dsn, schema)
    app.periodic("p", "* * * * * *", "k.p", missed="catch_up")
    periodic.sync_schedules(conn, storage, app)
    anchor(conn, schema, "p", "now() - interval '6 seconds'")
    periodic.evaluate_due(storage, conn)
    n = len(fires(storage, conn, "p"))
    assert n >= 5
    sql(conn, schema, "UPDATE __SCHEMA__.schedule_fires SET fired_at = fired_at - interval '8 days' RETURNING 1")
    assert storage.schedule_fires_prune(conn, periodic.FIRES_KEEP_S, 2) == 2  # batches
    assert storage.schedule_fires_prune(conn, periodic.FIRES_KEEP_S, 1000) == n - 3
    (kept,) = fires(storage, conn, "p")
    # the evaluator continues the chain from the kept fire: nothing is fired twice
    periodic.evaluate_due(storage, conn)
    after = fires(storage, conn, "p")
    assert all(r["tick"] > kept["tick"] for r in after[1:])
