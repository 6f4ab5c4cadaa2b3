"""``awa-fast status``: local claimers from shared memory, queues/rings/leader from the database."""

from __future__ import annotations

import pytest

from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import (
    QUEUE,
    cli,
    cli_json,
    counts,
    enqueue_bulk,
)

pytestmark = pytest.mark.integration


def _status(pg_dsn: str, schema: str, home, *extra: str):  # noqa: ANN001, ANN202
    return cli_json("status", "--json", "--schema", schema, "--dsn", pg_dsn, "--home", str(home), *extra)


def test_status_json_with_and_without_a_local_supervisor(pg_dsn, schema, storage, conn, tmp_path):
    n = 300
    home = tmp_path / "home"
    with SupervisorProc(pg_dsn, schema, tmp_path, home=home) as sup:
        pids = sup.wait_running(2)
        enqueue_bulk(pg_dsn, schema, "rt.sync", ({"i": i} for i in range(n)))
        wait_for(lambda: counts(storage, conn).get("completed", 0) == n, 30, "completions", on_timeout=sup.tail)

        def settled():  # noqa: ANN202 - counters are published after each flush
            data = _status(pg_dsn, schema, home, "--exact")
            local = data["local"]
            ok = local and sum(c["completed"] for c in local["claimers"]) == n \
                and local["maintenance"]["role"] == "leader"
            return data if ok else None
        data = wait_for(settled, 20, "status counters to reach the completions", interval=0.2,
                        on_timeout=lambda: str(_status(pg_dsn, schema, home)["local"]))

        local = data["local"]
        assert local["supervisor_pid"] == sup.pid and local["supervisor_alive"] is True
        by_stripe = {c["stripe"]: c for c in local["claimers"]}
        assert set(by_stripe) == {0, 1}
        for stripe, c in by_stripe.items():
            assert c["queue"] == QUEUE and c["state"] == "running" and c["pid"] == pids[(QUEUE, stripe)], c
            assert c["claimed"] >= c["completed"] and c["stale"] == 0 and c["in_flight"] == 0, c
            assert c["waiting"] == 0 and c["heartbeat_failures"] == 0, c
            # one handler sample per job run, one flush-size sample per flush (they add up to the outcomes)
            assert c["handler"]["count"] == c["completed"] == c["flush_jobs"]["sum"], c
            assert c["flush_jobs"]["count"] == c["batches_flushed"] and c["claim_jobs"]["sum"] == c["claimed"], c
        assert sum(c["claimed"] for c in by_stripe.values()) == n
        assert local["layout_version"] == 2 and set(local["maintenance"]["totals"]) == \
            {"promoted", "rescued_receipt", "rescued_lease"}
        assert local["maintenance"]["leader_pid"] == sup.maintenance_pid()
        # From the database: queue, rings, leader, exact counts.
        assert [q["queue"] for q in data["queues"]] == [QUEUE]
        assert set(data["rings"]) == {"ready", "claim", "lease"}
        assert all(r["slots"] == 4 and 0 <= r["slot"] < 4 and r["generation"] >= 0 for r in data["rings"].values()), \
            data["rings"]
        assert data["leader"]["application_name"] == f"awa_fast:maintenance:{schema}"
        assert data["counts"][QUEUE] == {"completed": n}

        # No local supervisor under this home: still reports from the database.
        other = _status(pg_dsn, schema, tmp_path / "elsewhere")
        assert other["local"] is None
        assert other["leader"]["pid"] == data["leader"]["pid"]
        assert set(other["rings"]) == {"ready", "claim", "lease"}
        assert [q["queue"] for q in other["queues"]] == [QUEUE]

        text = cli("status", "--schema", schema, "--dsn", pg_dsn, "--home", str(home))
        assert text.returncode == 0, text.stderr
        assert f"schema {schema}" in text.stdout and "leader: pid" in text.stdout
        assert text.stdout.count(f"claimer {QUEUE}#") == 2 and text.stdout.count(" waiting 0 ") == 2
        assert "maintenance here (leader): promoted " in text.stdout
        assert sup.stop() == 0, sup.tail()

    after = _status(pg_dsn, schema, home)
    assert after["local"] is None, "the locator of a stopped supervisor is still followed"
    assert after["leader"] is None
    assert set(after["rings"]) == {"ready", "claim", "lease"}


def test_waiting_counts_the_jobs_claimed_beyond_the_worker_slots(pg_dsn, schema, storage, conn, tmp_path):
    home = tmp_path / "home"
    with SupervisorProc(pg_dsn, schema, tmp_path, home=home, queues=[f"{QUEUE}:stripes=1,concurrency=2"]) as sup:
        sup.wait_running(1)
        go = tmp_path / "go"  # the handlers wait for it: the 6 stay waiting until the test has seen them
        enqueue_bulk(pg_dsn, schema, "rt.sleep", [{"ms": 1500, "until": str(go)}] * 8)

        def claimer() -> dict:
            local = _status(pg_dsn, schema, home)["local"]
            return local["claimers"][0] if local else {}
        # all 8 claimed, 2 running: 6 wait for a slot (the gauge is published with the status,
        # so the snapshot that first shows 8 held may predate the first two handlers' start)
        seen: list[dict] = []

        def held_with_six_waiting() -> dict | None:
            c = claimer()
            seen.append(c)
            return c if c.get("in_flight") == 8 and c.get("waiting") == 6 else None
        wait_for(held_with_six_waiting, 20, "the claimer to hold all 8 jobs with 6 waiting", interval=0.05,
                 on_timeout=lambda: f"last snapshots: {seen[-3:]}\n{sup.tail()}")
        assert all(c.get("waiting", 0) <= c.get("in_flight", 0) for c in seen), seen
        go.touch()
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 8, 30, "the jobs to complete")
        c = wait_for(lambda: (lambda c: c if c.get("completed") == 8 else None)(claimer()), 20, "the counters")
        assert (c["waiting"], c["in_flight"], c["handler"]["count"]) == (0, 0, 8), c
        assert 1.4 < c["handler"]["mean"] < 60.0, c["handler"]  # each slept 1.5 s (the first two also waited)
        assert sup.stop() == 0, sup.tail()
