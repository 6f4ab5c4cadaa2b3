"""Processes killed with SIGKILL under load: nothing lost, nothing completed twice.

- ``kill -9`` of one claimer: the supervisor restarts it, the leader rescues
  its open claims (heartbeat timeout lowered to 2 s), every job completes
  exactly once, some on attempt 2.
- Two supervisors on one database: exactly one maintenance leader; kill -9
  the leader's whole supervisor; the other leads within the election
  interval and rotation and rescue go on.
"""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest

from tests.fixtures.supervisor import SupervisorProc, group_gone, pid_alive
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import (
    QUEUE,
    RunLog,
    counts,
    done_rows_by_job,
    enqueue_bulk,
    rollups,
)

pytestmark = pytest.mark.integration

HEARTBEAT_TIMEOUT = 2.0


def _check_exactly_once(storage, conn, schema, ids, runlog):  # noqa: ANN001, ANN202
    """Every job completed once (exact counts, done rows); returns done rows by job."""
    final = counts(storage, conn)
    assert final == {"completed": len(ids)}, final
    done = done_rows_by_job(conn, schema)
    twice = {j: rows for j, rows in done.items() if len(rows) > 1}
    assert not twice, f"jobs with two done rows: {list(twice.items())[:5]}"
    assert set(done) <= ids
    assert len(done) + sum(rollups(conn, schema).values()) == len(ids)
    assert {e["job"] for e in runlog.entries("run")} == ids, "a job never ran to the end"
    return done


def _start_long_job_on(pid: int, dsn: str, schema: str, runlog: RunLog, sup: SupervisorProc,
                       others_hold: int) -> set[int]:
    """Enqueue 800 ms jobs at the tail of the backlog and return once claimer ``pid`` runs one.

    Short jobs of equal length run in lock step, so a claimer can be between two batches
    with no handler running; a kill then cuts nothing off. The long jobs outnumber what
    the other claimers can hold (``others_hold``: running plus buffered), so ``pid`` gets
    some, and the kill that follows lands while one of them runs. Returns their ids. The
    callers fix the claim size (``batch=16``: 8 running + 16 buffered = 24): an adaptive
    claimer grows its claims on a deep backlog and could take every long job.
    """
    long_ids = set(enqueue_bulk(dsn, schema, "rt.sleep", ({"ms": 800} for _ in range(others_hold + 36))))
    wait_for(lambda: any(e["pid"] == pid and e["job"] in long_ids for e in runlog.entries("start")),
             30, f"claimer {pid} to start a long job", interval=0.01, on_timeout=sup.tail)
    return long_ids


def test_kill_9_of_a_claimer_is_restarted_and_its_claims_rescued(pg_dsn, schema, storage, conn, tmp_path):
    storage.queue_configure(conn, QUEUE, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    runlog = RunLog(tmp_path / "runlog")
    n = 2000
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog,
                        queues=[f"{QUEUE}:stripes=2,concurrency=8,batch=16"]) as sup:
        pids = sup.wait_running(2)
        ids = set(enqueue_bulk(pg_dsn, schema, "rt.sleep", ({"ms": 20} for _ in range(n))))
        victim = pids[(QUEUE, 0)]
        # Mid-batch: the victim has finished some jobs and is running others right now.
        wait_for(lambda: sum(1 for e in runlog.entries("run") if e["pid"] == victim) >= 100, 30,
                 "the victim claimer to complete 100 jobs", on_timeout=sup.tail)
        ids |= _start_long_job_on(victim, pg_dsn, schema, runlog, sup, others_hold=24)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        wait_for(lambda: not pid_alive(victim), 10, "the victim to die")
        cut_off = {e["job"] for e in runlog.entries("start") if e["pid"] == victim} - \
            {e["job"] for e in runlog.entries("run") if e["pid"] == victim}
        assert cut_off, "the victim was running no handler when killed"

        new = wait_for(lambda: (p := sup.claimer_pids().get((QUEUE, 0))) and p != victim and p, 20,
                       "a new claimer for stripe 0", on_timeout=sup.tail)
        assert new != victim and sup.proc.poll() is None
        wait_for(lambda: counts(storage, conn).get("completed", 0) >= len(ids), 60, f"all {len(ids)} completed",
                 interval=0.1, on_timeout=lambda: f"{counts(storage, conn)}\n{sup.tail()}")
        local = sup.local_status()
        assert sup.stop() == 0, sup.tail()

    done = _check_exactly_once(storage, conn, schema, ids, runlog)
    # The jobs cut off by the kill were rescued: a second attempt ran them to the end.
    second = {e["job"]: e for e in runlog.entries("run") if e["attempt"] == 2}
    assert cut_off <= set(second), f"cut-off jobs not rerun on attempt 2: {sorted(cut_off - set(second))[:5]}"
    assert all(e["lease"] == 2 and e["t"] > killed_at + HEARTBEAT_TIMEOUT - 1.0 for e in second.values())
    assert all(done[j] == [(1, 2, 2)] for j in cut_off if j in done)
    # Only rescued jobs ran twice; nobody ran three times.
    per_job = collections.Counter(e["job"] for e in runlog.entries("run"))
    assert max(per_job.values()) <= 2
    assert "claimer q#0 exited with code -9" in sup.output()
    assert local is not None
    stripe0 = next(c for c in local["claimers"] if c["stripe"] == 0)
    assert stripe0["starts"] >= 2 and stripe0["pid"] == new, stripe0


def _leader_side(a: SupervisorProc, b: SupervisorProc) -> tuple[SupervisorProc, SupervisorProc] | None:
    """(leader, standby) by the shared-memory role each supervisor's maintenance publishes."""
    roles = {}
    for sup in (a, b):
        snap = sup.local_status()
        if not snap:
            return None
        roles[sup] = snap["maintenance"]
    leaders = [s for s, m in roles.items() if m["role"] == "leader" and m["leader_pid"]]
    standbys = [s for s, m in roles.items() if m["role"] == "standby"]
    if len(leaders) == 1 and len(standbys) == 1:
        return leaders[0], standbys[0]
    return None


def test_two_supervisors_one_leader_and_failover_after_kill_9(pg_dsn, schema, storage, conn, tmp_path):
    storage.queue_configure(conn, QUEUE, heartbeat_timeout=HEARTBEAT_TIMEOUT)
    runlog = RunLog(tmp_path / "runlog")
    n = 1500
    election = 0.5
    spec = [f"{QUEUE}:stripes=1,concurrency=8,batch=16"]
    with SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, name="a", queues=spec,
                        election_interval=election) as a, \
            SupervisorProc(pg_dsn, schema, tmp_path, runlog=runlog, name="b", queues=spec,
                           election_interval=election) as b:
        a.wait_running(1)
        b.wait_running(1)
        leader, standby = wait_for(lambda: _leader_side(a, b), 20, "one leader and one standby",
                                   on_timeout=lambda: a.tail() + "\n" + b.tail())
        info = storage.leader_info(conn)
        assert info is not None and info["application_name"] == f"awa_fast:maintenance:{schema}"
        lead_backend = info["pid"]
        # Exactly one backend holds the leader lock.
        holders = conn.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity s ON s.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND s.application_name = %s",
            (f"awa_fast:maintenance:{schema}",)).fetchone()[0]
        assert holders == 1

        ids = set(enqueue_bulk(pg_dsn, schema, "rt.sleep", ({"ms": 20} for _ in range(n))))
        leader_claimer = leader.claimer_pids()[(QUEUE, 0)]
        wait_for(lambda: sum(1 for e in runlog.entries("run") if e["pid"] == leader_claimer) >= 100, 30,
                 "the leader's claimer to complete 100 jobs", on_timeout=leader.tail)
        ids |= _start_long_job_on(leader_claimer, pg_dsn, schema, runlog, leader, others_hold=24)

        leader.kill_group(signal.SIGKILL)
        killed_at = time.monotonic()
        leader.wait(10)
        wait_for(lambda: group_gone(leader.pid), 10, "the killed supervisor's group to be gone")

        new_info = wait_for(lambda: (i := storage.leader_info(conn)) and i["pid"] != lead_backend and i, 10,
                            "a new leader", interval=0.01, on_timeout=standby.tail)
        takeover = time.monotonic() - killed_at
        assert takeover < election + 2.0, f"takeover took {takeover:.2f}s with election interval {election}s"
        assert new_info["application_name"] == f"awa_fast:maintenance:{schema}"
        wait_for(lambda: (m := (standby.local_status() or {}).get("maintenance")) and m["role"] == "leader", 10,
                 "the survivor to publish itself as leader", on_timeout=standby.tail)

        # Rotation goes on under the new leader: it rotates the claim ring (every 4 s, a full
        # interval of its own after its election) past where the ring was when it took over.
        took_over_at = int(storage.ring_state(conn)["claim"]["generation"])
        wait_for(lambda: int(storage.ring_state(conn)["claim"]["generation"]) > took_over_at, 15,
                 "the claim ring to rotate under the new leader", on_timeout=standby.tail)
        # Rescue goes on: the killed claimer's open claims come back and everything completes.
        wait_for(lambda: counts(storage, conn).get("completed", 0) >= len(ids), 60, f"all {len(ids)} completed",
                 interval=0.1, on_timeout=lambda: f"{counts(storage, conn)}\n{standby.tail()}")
        assert standby.stop() == 0, standby.tail()

    _check_exactly_once(storage, conn, schema, ids, runlog)
    cut_off = {e["job"] for e in runlog.entries("start") if e["pid"] == leader_claimer} - \
        {e["job"] for e in runlog.entries("run") if e["pid"] == leader_claimer}
    assert cut_off, "the killed claimer was running nothing"
    rescued = {e["job"] for e in runlog.entries("run") if e["attempt"] == 2}
    assert cut_off <= rescued


def test_children_do_not_outlive_a_kill_9_of_the_supervisor(pg_dsn, schema, storage, conn, tmp_path):
    """A supervisor killed alone (OOM killer, kill -9 of its pid) must not leave orphan claimers.

    Orphans keep claiming with nobody to restart, stop or account for them,
    next to the supervisor that replaces the dead one.
    """
    with SupervisorProc(pg_dsn, schema, tmp_path, queues=[f"{QUEUE}:stripes=2,concurrency=4"]) as sup:
        sup.wait_running(2)
        kids = wait_for(lambda: (k := sup.children()) and len(k) == 3 and k, 10, "three children")
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(pid_alive(p) for p in kids):
            time.sleep(0.05)
        orphans = [p for p in kids if pid_alive(p)]
        apps = [r[0] for r in conn.execute(
            "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE 'awa_fast:%%' "
            "AND application_name NOT LIKE 'awa_fast:test:%%' AND datname IS NOT NULL").fetchall()]
        assert not orphans, f"children {orphans} still run 5 s after their supervisor died: {sorted(apps)}"
