"""Process chaos: SIGKILL a claimer, the whole supervisor group, the maintenance leader; SIGSTOP a claimer.

Each scenario runs real ``awa-fast supervise`` process groups against a
dedicated PostgreSQL, kills or freezes real processes, waits for the
database to show the outcome, and ends with the exact invariant check.
"""

from __future__ import annotations

import os
import pathlib
import signal
import time

import psycopg

from tests.chaos.chaos_helpers import (
    Expect,
    Supervise,
    check_invariants,
    check_live,
    enqueue_many,
    enqueue_one,
    enqueue_rolled_back,
    leader_backend,
    process_state,
    q,
    read_exec_log,
    record_figures,
    scalar,
    supervisors,
    terminal_count,
    wait_terminal,
)
from tests.fixtures.waiting import wait_for

SCHEMA_PREFIX = "kills"  # schema names of this module (the conftest fixture `schema`)


def in_flight_by_pid(exec_log: pathlib.Path) -> dict[int, int]:
    """Attempts started and not yet returned, per claimer pid."""
    open_: dict[tuple[int, int], int] = {}
    for e in read_exec_log(exec_log):
        if e.what == "start":
            open_[(e.job_id, e.run_lease)] = e.pid
        else:
            open_.pop((e.job_id, e.run_lease), None)
    out: dict[int, int] = {}
    for pid in open_.values():
        out[pid] = out.get(pid, 0) + 1
    return out


def test_kill9_claimer_mid_batch(pg, obs, schema, tmp_path):
    n = 2000
    enqueue_many(pg.dsn, schema, n, {"sleep": 0.02})
    rolled_back = enqueue_rolled_back(pg.dsn, schema)
    sup = Supervise(pg.dsn, schema, tmp_path)
    with supervisors(sup.start()):
        wait_for(lambda: len(read_exec_log(sup.exec_log)) > 400, 20, "400 executions")
        busy = wait_for(lambda: {p: k for p, k in in_flight_by_pid(sup.exec_log).items()
                                 if p in sup.claimer_pids() and k >= 4}, 10, "a claimer with handlers in flight")
        victim = max(busy, key=busy.get)
        name = next(k for k, v in sup.children().items() if v == victim)
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        # the supervisor restarts the claimer ...
        wait_for(lambda: sup.children().get(name) not in (None, victim), 10, f"{name} to be restarted")
        t_restart = time.monotonic() - t_kill
        # ... and every job ends, the cut ones after rescue
        wait_terminal(obs, schema, n, 60)
        t_all = time.monotonic() - t_kill
        check_live(obs, schema)
        assert sup.stop() == 0, sup.log()[-3000:]
    figures = check_invariants(obs, schema, Expect(n, {"completed": n}, rolled_back=rolled_back,
                                                   killed_pids={victim}),
                               sup.exec_log, sup.stale_rejected(), supervisors_stopped=True)
    assert figures["reexecuted_after_kill"] >= 1, figures
    assert figures["rescued_attempts"] >= figures["reexecuted_after_kill"]
    # recovery bound: restart within the backoff, the cut attempts rescued (2 s + 0.5 s) and run
    assert t_restart < 2.0 and t_all < 15.0, (t_restart, t_all)
    record_figures("kill9_claimer", restart_s=round(t_restart, 2), all_done_after_kill_s=round(t_all, 2),
                   **figures)


def test_kill9_whole_supervisor_group_then_restart(pg, obs, schema, tmp_path):
    n = 2000
    enqueue_many(pg.dsn, schema, n, {"sleep": 0.02})
    sup = Supervise(pg.dsn, schema, tmp_path)
    with supervisors(sup.start()):
        wait_for(lambda: terminal_count(obs, schema) > 300, 20, "300 completions")
        killed = set(sup.claimer_pids()) | {sup.children()["maintenance"]}
        sup.kill_group()
        t_kill = time.monotonic()
        # every backend of the dead group goes away with its process (locks too)
        wait_for(lambda: not [x for x in q(obs, "SELECT pid FROM pg_stat_activity WHERE application_name "
                                                "LIKE 'awa_fast%'")], 10, "the dead group's sessions to end")
        assert leader_backend(obs, schema) is None
        done_at_kill = terminal_count(obs, schema)
        assert done_at_kill < n
        sup2 = Supervise(pg.dsn, schema, tmp_path, name="sup2")
        with supervisors(sup2.start()):
            t_up = time.monotonic() - t_kill
            wait_terminal(obs, schema, n, 60)
            t_all = time.monotonic() - t_kill
            check_live(obs, schema)
            assert sup2.stop() == 0, sup2.log()[-3000:]
    figures = check_invariants(obs, schema, Expect(n, {"completed": n}, killed_pids=killed), sup.exec_log,
                               sup.stale_rejected() + sup2.stale_rejected(), supervisors_stopped=True)
    assert figures["reexecuted_after_kill"] >= 1, figures
    assert t_all < 20.0, t_all
    leaked = sup.remove_leaked_shm()  # the killed supervisor's segment (reported as a leak)
    record_figures("kill9_group", done_at_kill=done_at_kill, new_supervisor_up_s=round(t_up, 2),
                   all_done_after_kill_s=round(t_all, 2), shm_segments_leaked_by_killed_group=leaked,
                   **figures)


def test_kill9_maintenance_leader_mid_prune(pg, obs, schema, tmp_path):
    """Two supervisors; the leader is killed while inside ring_prune; the other one takes over."""
    a = Supervise(pg.dsn, schema, tmp_path, name="supA", stripes=1, concurrency=8)
    b = Supervise(pg.dsn, schema, tmp_path, name="supB", stripes=1, concurrency=8)
    n = 600
    with supervisors(a.start(), b.start()):
        leader = wait_for(lambda: (a.leader_pids() and a) or (b.leader_pids() and b), 10, "a maintenance leader")
        standby = b if leader is a else a
        leader_pid = leader.children()["maintenance"]
        assert leader.leader_pids()[-1] == leader_pid
        enqueue_many(pg.dsn, schema, n, {"sleep": 0.005})
        wait_terminal(obs, schema, n, 60)
        s = f'"{schema}"'
        # a sealed claim slot with closed receipts: prune wants it; a reader makes prune wait on its lock
        wait_for(lambda: scalar(obs, f"SELECT generation FROM {s}.ring_rotations WHERE ring = 'claim' "
                                     "ORDER BY generation DESC LIMIT 1") >= 1, 10, "a claim rotation")
        blocker = psycopg.connect(pg.dsn, autocommit=False, application_name="chaos:blocker")
        try:
            enqueue_many(pg.dsn, schema, 200, {"sleep": 0.001})
            wait_terminal(obs, schema, n + 200, 30)
            slots = [int(r[0]) for r in q(obs, f"SELECT slot FROM {s}.ring_slots WHERE ring = 'claim'")]
            for slot in slots:
                blocker.execute(f"SELECT 1 FROM {s}.lease_claims_{slot} LIMIT 1")
            backend = leader_backend(obs, schema)

            def leader_in_prune() -> bool:
                row = obs.execute("SELECT query, wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                  (backend,)).fetchone()
                return bool(row and "ring_prune" in (row[0] or "") and row[1] == "Lock")

            wait_for(leader_in_prune, 20, "the leader to wait inside ring_prune", interval=0.002)
            os.kill(leader_pid, signal.SIGKILL)
            t_kill = time.monotonic()
            blocker.rollback()
        finally:
            blocker.close()
        new_backend = wait_for(lambda: (leader_backend(obs, schema) or 0) not in (0, backend)
                               and leader_backend(obs, schema), 10, "a new leader")
        t_takeover = time.monotonic() - t_kill
        gen0 = scalar(obs, f"SELECT max(generation) FROM {s}.ring_rotations WHERE ring = 'claim'")
        # pruning resumes under the new leader: new claims fill the ring, it rotates, and every
        # sealed claim slot is truncated once its receipts are closed
        m = enqueue_many(pg.dsn, schema, 300, {"sleep": 0.002})
        wait_terminal(obs, schema, n + 200 + m, 30)

        def sealed_claim_slots_pruned() -> bool:
            cur = scalar(obs, f"SELECT slot FROM {s}.ring_rotations WHERE ring = 'claim' "
                              "ORDER BY generation DESC LIMIT 1")
            gen = scalar(obs, f"SELECT max(generation) FROM {s}.ring_rotations WHERE ring = 'claim'")
            rows = sum(scalar(obs, f"SELECT count(*) FROM {s}.lease_claims_{i}") for i in slots if i != cur)
            return gen > gen0 and rows == 0

        wait_for(sealed_claim_slots_pruned, 15, "the new leader to rotate and prune the claim ring")
        t_resumed = time.monotonic() - t_kill
        check_live(obs, schema)
        assert t_takeover < 3.0, t_takeover  # within a few election intervals (0.5 s)
        assert a.stop() == 0 and b.stop() == 0
    new_leader_sup = standby if standby.leader_pids() else leader
    figures = check_invariants(obs, schema, Expect(n + 500, {"completed": n + 500}), a.exec_log,
                               a.stale_rejected() + b.stale_rejected(), supervisors_stopped=True)
    record_figures("kill9_leader_mid_prune", takeover_s=round(t_takeover, 2),
                   pruning_resumed_s=round(t_resumed, 2), new_leader_backend=new_backend,
                   new_leader_in=new_leader_sup.name, **figures)


def test_sigstop_claimer_past_heartbeat_then_sigcont(pg, obs, schema, tmp_path):
    """A frozen claimer's job is rescued and completed by the other stripe; its late completion is stale."""
    sup = Supervise(pg.dsn, schema, tmp_path, stripes=2, concurrency=4)
    with supervisors(sup.start()):
        job = enqueue_one(obs, schema, {"sleep": 1.0})
        start = wait_for(lambda: [e for e in read_exec_log(sup.exec_log) if e.what == "start" and e.job_id == job],
                         10, "the job to start")[0]
        frozen = start.pid
        os.kill(frozen, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            wait_for(lambda: process_state(frozen) == "T", 5, "the claimer to stop")
            # rescued (heartbeat stale after 2 s) and completed by the other stripe
            wait_for(lambda: terminal_count(obs, schema) == 1, 20, "the rescued job to complete elsewhere")
            t_rescued = time.monotonic() - t_stop
            [(rl, att, by)] = q(obs, f'SELECT run_lease, attempt, state FROM "{schema}_audit".terminal')
            assert (rl, att, by) == (2, 2, "completed")
            other = [e for e in read_exec_log(sup.exec_log) if e.job_id == job and e.run_lease == 2]
            assert other and other[0].pid != frozen
        finally:
            os.kill(frozen, signal.SIGCONT)
        t_cont = time.monotonic()
        # the frozen handler wakes up, finishes, and its completion is rejected as stale
        wait_for(lambda: sup.stale_rejected() >= 1, 15, "the late completion to be rejected as stale")
        t_stale = time.monotonic() - t_cont
        assert terminal_count(obs, schema) == 1
        check_live(obs, schema)
        assert sup.stop() == 0, sup.log()[-2000:]
    figures = check_invariants(obs, schema, Expect(1, {"completed": 1}), sup.exec_log, sup.stale_rejected(),
                               supervisors_stopped=True)
    assert figures["executions_of_rescued_attempts"] == 1 and figures["stale_rejected_logged"] == 1, figures
    record_figures("sigstop_claimer", rescued_and_completed_s=round(t_rescued, 2),
                   stale_rejected_after_sigcont_s=round(t_stale, 2), **figures)
