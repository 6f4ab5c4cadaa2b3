"""Per-key concurrency (sql/0012_key_limits.sql, docs/flow-control.md), at the storage level:
the claim admits at most key_max_running jobs of a key, frees a key's slot when its job ends
(completion, failure, cancel), keeps it across a retry and a rescue, and never puts a
saturated key's backlog in front of another key's job."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest

from awa_fast.app import App
from awa_fast.client import Client
from awa_fast.errors import ConfigError, InvalidName
from awa_fast.limits import LimitWatch
from tests.fixtures.database import sqlx_all as sqlx
from tests.integration.runtime_helpers import counts

pytestmark = pytest.mark.integration

Q = "keyed"


def _claim(storage, conn, n=100):  # noqa: ANN001, ANN202
    return storage.lane_claim_keyed_result(conn, Q, n, 0, 1)


def _keys(conn, schema, snaps) -> Counter:  # noqa: ANN001
    """Key of each claimed job, from the admissions (a claimed keyed job is admitted)."""
    ids = [s.job_id for s in snaps]
    rows = sqlx(conn, schema, "SELECT job_id, ckey FROM __SCHEMA__.key_admits WHERE job_id = ANY(%s)", (ids,))
    by = dict(rows)
    return Counter(by.get(i) for i in ids)


def test_claim_admits_at_most_the_key_limit_and_frees_on_completion(pg_dsn, schema, storage, conn):
    storage.queue_key_limit_set(conn, Q, 2)
    client = Client(pg_dsn, schema)
    a = [client.enqueue("k.work", {"i": i}, queue=Q, concurrency_key="A") for i in range(5)]
    b = client.enqueue("k.work", {"b": 1}, queue=Q, concurrency_key="B")
    plain = client.enqueue("k.work", {"plain": 1}, queue=Q)
    client.close()
    assert storage.queue_key_status(conn)[Q] == {"key_max_running": 2, "waiting": 6, "keys_waiting": 2,
                                                 "admitted": 0}
    got, more = _claim(storage, conn)
    assert sorted(s.job_id for s in got) == sorted([a[0], a[1], b, plain])
    assert more, "due jobs still wait on key A: come back"
    assert _claim(storage, conn) == ([], True)
    assert storage.queue_key_status(conn)[Q]["waiting"] == 3
    # completion frees A's slot: the next oldest A job, exactly one
    done_a = [s for s in got if s.job_id == a[0]]
    storage.receipt_complete_rows(conn, done_a)
    got2, _ = _claim(storage, conn)
    assert [s.job_id for s in got2] == [a[2]]
    # failure (terminal) frees it too
    fail = [s for s in got if s.job_id == a[1]][0]
    assert storage.attempt_close(conn, [(fail, 2, None, "boom")])
    got3, _ = _claim(storage, conn)
    assert [s.job_id for s in got3] == [a[3]]
    # cancel of a waiting job: gone from the gate, recorded cancelled
    assert storage.job_cancel(conn, a[4]) == "cancelled"
    assert storage.queue_key_status(conn)[Q]["waiting"] == 0
    assert counts(storage, conn, Q).get("cancelled") == 1


def test_retry_keeps_the_slot_and_rescue_reruns_in_it(pg_dsn, schema, storage, conn):
    storage.queue_key_limit_set(conn, Q, 2)
    client = Client(pg_dsn, schema)
    ids = client.enqueue_many("k.work", [{"i": i} for i in range(6)], queue=Q, concurrency_key="A",
                              return_ids=True)
    client.close()
    got, _ = _claim(storage, conn)
    assert [s.job_id for s in got] == ids[:2]
    # a retry (due at once) keeps its admission: the retried job comes back, not a third one
    assert storage.attempt_close(conn, [(got[0], 4, 0.0, "again")])
    assert storage.deferred_promote(conn) == 1
    again, _ = _claim(storage, conn)
    assert [s.job_id for s in again] == [ids[0]] and again[0].attempt == 2
    # rescue closes the stale attempts' receipts; the jobs run again in their own slots
    storage.queue_configure(conn, Q, heartbeat_timeout=0.2)
    time.sleep(0.4)
    assert storage.receipt_rescue_stale(conn) == 2
    rerun, _ = _claim(storage, conn)
    assert sorted(s.job_id for s in rerun) == ids[:2]
    assert storage.queue_key_status(conn)[Q]["admitted"] == 2
    storage.receipt_complete_rows(conn, rerun)
    nxt, _ = _claim(storage, conn)
    assert [s.job_id for s in nxt] == ids[2:4]
    # a job that moved to another ready slot (retried after a rotation) ends there: its slot
    # still frees, found by the every-partition probe that covers an eighth of the admissions per call
    assert storage.attempt_close(conn, [(nxt[0], 4, 0.0, "again")])
    assert storage.ring_rotate(conn, "ready") is not None
    assert storage.deferred_promote(conn) == 1
    moved, _ = _claim(storage, conn)
    assert [s.job_id for s in moved] == [ids[2]] and moved[0].ready_slot != nxt[0].ready_slot
    storage.receipt_complete_rows(conn, moved)
    for _ in range(200):
        freed, _ = _claim(storage, conn)
        if freed:
            break
    assert [s.job_id for s in freed] == [ids[4]]


def test_hot_key_does_not_delay_a_cold_key(pg_dsn, schema, storage, conn):
    storage.queue_key_limit_set(conn, Q, 2)
    client = Client(pg_dsn, schema)
    client.enqueue_many("k.work", [{"i": i} for i in range(10_000)], queue=Q, concurrency_key="hot")
    hot_running, _ = _claim(storage, conn, 8)
    assert len(hot_running) == 2
    cold = client.enqueue("k.work", {"cold": True}, queue=Q, concurrency_key="cold")
    client.close()
    t0 = time.perf_counter()
    got, more = _claim(storage, conn, 8)
    took = time.perf_counter() - t0
    assert [s.job_id for s in got] == [cold], "the cold key's job is claimed by the next claim call"
    assert more
    # the hot backlog never entered the lane: the claim read none of it
    lane_rows = sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.ready_entries")[0][0]
    assert lane_rows == 3
    assert took < 1.0, f"one claim call took {took:.3f}s with 10,000 jobs waiting on a hot key"
    # and admission does not read the hot backlog: a few buffers, not the 10,000 waiting rows
    plan = sqlx(conn, schema, "EXPLAIN (ANALYZE, BUFFERS) SELECT __SCHEMA__.key_admit(%s, 2)", (Q,))
    buffers = sum(int(m) for line, in plan for m in re.findall(r"shared hit=(\d+)", line)[:1])
    assert buffers < 1000, f"admission read {buffers} buffers with 10,000 jobs waiting on one key"


def test_without_a_key_limit_keys_cost_nothing_and_removal_releases(pg_dsn, schema, storage, conn):
    client = Client(pg_dsn, schema)
    ids = client.enqueue_many("k.work", [{"i": i} for i in range(4)], queue=Q, concurrency_key="A",
                              return_ids=True)
    one = client.enqueue("k.work", {}, queue=Q, concurrency_key="A")
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.key_waiting")[0][0] == 0
    watch = LimitWatch(storage, Q, refresh=0.0)
    assert watch.claim_call(conn) == storage.lane_claim_result
    assert len(storage.lane_claim_result(conn, Q, 100)[0]) == 5 and one > 0 and len(ids) == 4
    storage.queue_key_limit_set(conn, Q, 1)
    assert watch.claim_call(conn) == storage.lane_claim_keyed_result
    client.enqueue_many("k.work", [{"i": i} for i in range(3)], queue=Q, concurrency_key=["A", None, "A"])
    client.enqueue("k.work", {}, queue=Q, concurrency_key="B", delay=3600)
    client.close()
    assert storage.queue_key_status(conn)[Q]["waiting"] == 3
    # removing the limit lets the waiting jobs go: due ones to the lane, the scheduled one to deferred
    assert storage.queue_key_limit_set(conn, Q, None) == 2
    assert storage.queue_key_status(conn) == {}
    assert len(storage.lane_claim_result(conn, Q, 100)[0]) == 3
    assert counts(storage, conn, Q).get("scheduled") == 1
    assert watch.claim_call(conn) == storage.lane_claim_result


def test_bad_keys_are_typed_errors_before_anything_is_written(pg_dsn, schema, storage, conn):
    storage.queue_key_limit_set(conn, Q, 2)
    client = Client(pg_dsn, schema)
    try:
        for bad in ("", "   ", "x" * 256, 42, b"k", "a\x00b"):
            with pytest.raises(InvalidName):
                client.enqueue("k.work", {}, queue=Q, concurrency_key=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidName):
            client.enqueue_many("k.work", [{}, {}], queue=Q, concurrency_key=["ok", 7])  # type: ignore[list-item]
        with pytest.raises(ConfigError):
            client.enqueue_many("k.work", [{}, {}], queue=Q, concurrency_key=["a"])
        from awa_fast.unique import Unique

        with pytest.raises(ConfigError):
            client.enqueue("k.work", {}, queue=Q, concurrency_key="a", unique=Unique())
        for bad_n in (0, -1, True, 2.5):
            with pytest.raises(ConfigError):
                storage.queue_key_limit_set(conn, Q, bad_n)  # type: ignore[arg-type]
    finally:
        client.close()
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.key_waiting")[0][0] == 0
    assert counts(storage, conn, Q) == {}


def test_app_kind_key_function_and_configure(pg_dsn, schema, storage, conn):
    app = App(pg_dsn, schema)
    try:
        @app.job("k.sync", queue=Q, concurrency_key=lambda args: f"customer:{args['customer']}")
        def sync(job):  # noqa: ANN001, ANN202
            return None

        settings = app.configure_queue(Q, key_max_running=1)
        assert settings.key_max_running == 1
        first = app.enqueue("k.sync", {"customer": 1})
        app.enqueue_many("k.sync", [{"customer": 1}, {"customer": 2}, {"customer": 2}])
        app.enqueue("k.sync", {"customer": 3}, concurrency_key="override")
        st = storage.queue_key_status(conn)[Q]
        assert (st["waiting"], st["keys_waiting"]) == (5, 3)
        # a waiting job is visible: available (it runs once its key has room), counted, and
        # keeps an until_empty worker from stopping
        info = app.get_job(first)
        assert info is not None and info.state == "available" and info.args == {"customer": 1}
        assert app.counts(Q)[Q]["available"] == 5
        assert storage.queue_work_exists(conn, [Q])
        got, _ = _claim(storage, conn)
        assert _keys(conn, schema, got) == Counter({"customer:1": 1, "customer:2": 1, "override": 1})
        assert app.queue_settings(Q).key_max_running == 1
        assert app.configure_queue(Q, key_max_running=None).key_max_running is None
    finally:
        app.close()


def test_cli_configure_and_status_show_jobs_waiting_on_a_key(pg_dsn, schema, storage, conn, capsys, tmp_path):
    import json

    from awa_fast import cli

    base = ["--dsn", pg_dsn, "--schema", schema, "--home", str(tmp_path)]
    assert cli.main(["queue", "configure", Q, "--key-max-running", "3", "--json", *base]) == 0
    assert json.loads(capsys.readouterr().out)["key_max_running"] == 3
    client = Client(pg_dsn, schema)
    client.enqueue_many("k.work", [{} for _ in range(5)], queue=Q, concurrency_key="A")
    client.enqueue("k.work", {}, queue=Q, concurrency_key="B")
    client.close()
    assert cli.main(["status", "--json", *base]) == 0
    assert json.loads(capsys.readouterr().out)["key_limits"][Q] == {
        "key_max_running": 3, "waiting": 6, "keys_waiting": 2, "admitted": 0}
    assert cli.main(["status", *base]) == 0
    assert "key limit 3: 6 jobs waiting on 2 keys" in capsys.readouterr().out
    assert cli.main(["queue", "configure", Q, "--key-max-running", "0", *base]) != 0
    assert "key_max_running=0" in capsys.readouterr().err
    assert cli.main(["queue", "configure", Q, "--key-max-running", "none", "--json", *base]) == 0
    assert json.loads(capsys.readouterr().out)["key_max_running"] is None
    assert storage.queue_key_status(conn) == {}
    assert len(storage.lane_claim_result(conn, Q, 100)[0]) == 6


def test_metrics_export_jobs_waiting_on_a_key(pg_dsn, schema, storage, conn):
    from awa_fast.metrics import StorageGauges, _storage_metrics

    storage.queue_key_limit_set(conn, Q, 1)
    client = Client(pg_dsn, schema)
    client.enqueue_many("k.work", [{} for _ in range(4)], queue=Q, concurrency_key="A")
    client.close()
    gauges = StorageGauges(pg_dsn, schema)
    gauges.refresh_once()
    assert gauges.error is None, gauges.error
    fams = {f.name: f for f in _storage_metrics(gauges)}
    samples = {s.labels["queue"]: s.value for s in fams["awa_fast_key_waiting_jobs"].samples}
    assert samples == {Q: 4.0}
    _claim(storage, conn)
    gauges.refresh_once()
    fams = {f.name: f for f in _storage_metrics(gauges)}
    assert {s.labels["queue"]: s.value for s in fams["awa_fast_key_waiting_jobs"].samples} == {Q: 3.0}


def test_job_list_shows_jobs_waiting_on_their_key(pg_dsn, schema, storage, conn):
    storage.queue_key_limit_set(conn, Q, 1)
    client = Client(pg_dsn, schema)
    a = [client.enqueue("k.work", {"i": i}, queue=Q, concurrency_key="A") for i in range(3)]
    later = client.enqueue("k.work", {}, queue=Q, concurrency_key="B", delay=3600)
    client.close()
    got, _ = _claim(storage, conn)
    assert [s.job_id for s in got] == [a[0]]  # a[1], a[2] and later wait in key_waiting
    listed = {j["job_id"]: j["state"] for j in storage.job_list(conn, queue=Q)}
    assert listed == {a[0]: "running", a[1]: "available", a[2]: "available", later: "scheduled"}
    assert [j["job_id"] for j in storage.job_list(conn, state="available")] == [a[2], a[1]]
    assert [j["job_id"] for j in storage.job_list(conn, state="scheduled", kind="k.work")] == [later]
    assert [j["job_id"] for j in storage.job_list(conn, queue=Q, limit=2, before_id=a[2])] == [a[1], a[0]]


def _dead_letter_one(storage, conn, client):  # noqa: ANN001, ANN202
    """A key-A job on a limit of 1, claimed and failed for good (max_attempts=1): its id and claimed lease."""
    storage.queue_key_limit_set(conn, Q, 1)
    dead = client.enqueue("k.work", {"i": 0}, queue=Q, concurrency_key="A", max_attempts=1)
    got, _ = _claim(storage, conn)
    assert [s.job_id for s in got] == [dead]
    assert storage.attempt_close(conn, [(got[0], 2, None, "boom")])
    return dead, got[0].run_lease


def test_dlq_retry_of_a_keyed_job_waits_for_its_keys_room(pg_dsn, schema, storage, conn):
    client = Client(pg_dsn, schema)
    dead, first_lease = _dead_letter_one(storage, conn, client)
    assert storage.job_load(conn, dead)["state"] == "dlq"
    # the next claim retires the dead job's admission; the key's next job takes the one slot
    nxt = client.enqueue("k.work", {"i": 1}, queue=Q, concurrency_key="A")
    running, _ = _claim(storage, conn)
    assert [s.job_id for s in running] == [nxt]
    assert sqlx(conn, schema, "SELECT job_id, ckey FROM __SCHEMA__.key_dlq") == [(dead, "A")]
    # the retried job waits for A's room instead of running beside nxt
    assert storage.dlq_retry(conn, [dead]) == [dead]
    job = storage.job_load(conn, dead)
    assert (job["state"], job["concurrency_key"], job["run_lease"]) == ("available", "A", first_lease)
    assert [e["error"] for e in job["errors"]] == ["boom"]
    assert _claim(storage, conn) == ([], True)
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.key_dlq") == [(0,)]
    storage.receipt_complete_rows(conn, running)
    again, _ = _claim(storage, conn)
    assert [s.job_id for s in again] == [dead]
    assert again[0].run_lease > first_lease, "a lease of an earlier attempt is never handed out again"
    assert storage.queue_key_status(conn)[Q]["admitted"] == 1
    client.close()


def test_dlq_retry_before_any_claim_keeps_the_admission_and_purge_forgets_keys(pg_dsn, schema, storage, conn):
    client = Client(pg_dsn, schema)
    dead, _ = _dead_letter_one(storage, conn, client)
    # retried before a claim retired its admission: back in the lane, in its own slot
    assert storage.dlq_retry(conn, [dead]) == [dead]
    other = client.enqueue("k.work", {"i": 1}, queue=Q, concurrency_key="A")
    rerun, _ = _claim(storage, conn)
    assert [s.job_id for s in rerun] == [dead]
    assert storage.queue_key_status(conn)[Q]["admitted"] == 1
    assert _claim(storage, conn) == ([], True)
    # dead-lettered again; the retire keeps its key; a purge forgets the key with the entry
    assert storage.attempt_close(conn, [(rerun[0], 2, None, "boom again")])
    freed, _ = _claim(storage, conn)
    assert [s.job_id for s in freed] == [other]
    assert sqlx(conn, schema, "SELECT job_id FROM __SCHEMA__.key_dlq") == [(dead,)]
    assert storage.dlq_purge(conn, [dead]) == 1
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.key_dlq") == [(0,)]
    client.close()


def test_removing_the_key_limit_keeps_a_retried_jobs_lease(pg_dsn, schema, storage, conn):
    client = Client(pg_dsn, schema)
    dead, first_lease = _dead_letter_one(storage, conn, client)
    hold = client.enqueue("k.work", {"i": 1}, queue=Q, concurrency_key="A")
    running, _ = _claim(storage, conn)
    assert [s.job_id for s in running] == [hold]
    assert storage.dlq_retry(conn, [dead]) == [dead]
    storage.queue_key_limit_set(conn, Q, None)  # the waiting job goes to the lane, through deferred_jobs
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.key_dlq") == [(0,)]
    storage.deferred_promote(conn)
    back, _ = _claim(storage, conn)
    assert [s.job_id for s in back] == [dead] and back[0].run_lease > first_lease
    client.close()


def test_one_dlq_retry_of_many_entries_gives_each_its_own_key(pg_dsn, schema, storage, conn):
    storage.queue_key_limit_set(conn, Q, 1)
    client = Client(pg_dsn, schema)
    dead = {k: client.enqueue("k.work", {"k": k}, queue=Q, concurrency_key=k, max_attempts=1) for k in "ABC"}
    plain = client.enqueue("k.work", {"plain": 1}, queue="unkeyed", max_attempts=1)
    got, _ = _claim(storage, conn)
    got += storage.lane_claim_result(conn, "unkeyed", 10, 0, 1)[0]
    assert storage.attempt_close(conn, [(s, 2, None, "boom") for s in got])
    assert _claim(storage, conn) == ([], False)  # retires the three admissions, keeping their keys
    assert sorted(sqlx(conn, schema, "SELECT ckey FROM __SCHEMA__.key_dlq")) == [("A",), ("B",), ("C",)]
    assert sorted(storage.dlq_retry(conn, [*dead.values(), plain])) == sorted([*dead.values(), plain])
    for k, job_id in dead.items():
        assert storage.job_load(conn, job_id)["concurrency_key"] == k
    assert "concurrency_key" not in storage.job_load(conn, plain)
    assert sqlx(conn, schema, "SELECT count(*) FROM __SCHEMA__.key_dlq") == [(0,)]
    client.close()
