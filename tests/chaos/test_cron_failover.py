"""Periodic jobs through leader failover: two real supervisors, the leader SIGKILLed twice.

A per-second schedule runs for about 30 s while the maintenance leader (the
only evaluator) is killed with SIGKILL twice, and frozen (SIGSTOP, keeping
its lock) for three ticks once before the second kill, so some ticks are
missed and coalesced. Checked from the fire ledger
and the audit triggers (which survive ring prune): the scheduled fires form
one chain from the first to the last tick, every second of that window is
either fired or counted as coalesced into the next fire (the coalesce
policy), no tick fired twice, each fire enqueued exactly one job, and every
job ran to completion.
"""

from __future__ import annotations

import os
import signal
import time

from tests.chaos.chaos_helpers import APP_REF, Supervise, leader_backend, q, record_figures, supervisors
from tests.fixtures.waiting import wait_for

SCHEMA_PREFIX = "cron"
CRON_APP = "tests.chaos.cron_app:app"


def _supervise(dsn: str, schema: str, workdir, name: str) -> Supervise:  # noqa: ANN001
    sup = Supervise(dsn, schema, workdir / name, stripes=1, name=name)
    sup.argv[sup.argv.index(APP_REF)] = CRON_APP
    return sup


def _fires(obs, schema: str) -> list[tuple]:  # noqa: ANN001
    return q(obs, f'SELECT tick, prev_tick, coalesced, job_id, manual FROM "{schema}".schedule_fires '
                  "WHERE schedule = 'per_second' ORDER BY tick")


def _leader(sups: tuple[Supervise, ...]) -> tuple[Supervise, int] | None:
    """The supervisor whose live maintenance child was elected (leadership ends only with its connection)."""
    for s in sups:
        child = s.children().get("maintenance")
        if child is not None and child in s.leader_pids():
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                continue
            return s, child
    return None


def test_per_second_schedule_fires_each_tick_once_through_two_leader_kills(pg, obs, schema, tmp_path):
    a = _supervise(pg.dsn, schema, tmp_path, "a")
    b = _supervise(pg.dsn, schema, tmp_path, "b")
    kills = []
    started = time.monotonic()
    with supervisors(a.start(), b.start()):
        for round_ in range(3):
            sup, pid = wait_for(lambda: _leader((a, b)), 15, "a maintenance leader")
            backend = leader_backend(obs, schema)
            n = len(_fires(obs, schema))
            wait_for(lambda: len(_fires(obs, schema)) >= n + 8, 20, "eight more fires under this leader")
            if round_ == 2:
                break
            if round_ == 1:
                # freeze the leader (it keeps its lock): ticks come due unfired; thawed, it coalesces them
                os.kill(pid, signal.SIGSTOP)
                frozen = q(obs, "SELECT now()")[0][0]
                wait_for(lambda: (q(obs, "SELECT now()")[0][0] - frozen).total_seconds() > 3.2, 10,
                         "three ticks on the database clock")
                os.kill(pid, signal.SIGCONT)
                wait_for(lambda: any(r[2] >= 2 for r in _fires(obs, schema)), 10, "a coalesced fire")
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            wait_for(lambda: (leader_backend(obs, schema) or backend) != backend, 15, "a new leader")
            kills.append(round(time.monotonic() - killed_at, 2))
        wait_for(lambda: time.monotonic() - started >= 30, 40, "30 s of schedule")
        last = _fires(obs, schema)[-1]
        # every fired job runs to completion (the schedule keeps firing meanwhile: wait for these)
        wanted = {int(r[3]) for r in _fires(obs, schema) if r[0] <= last[0]}
        wait_for(lambda: wanted <= {int(r[0]) for r in q(obs, f'SELECT job_id FROM "{schema}_audit".terminal '
                                                               "WHERE state = 'completed'")},
                 30, "every fired job to complete")
    rows = [r for r in _fires(obs, schema) if r[0] <= last[0]]
    assert not any(r[4] for r in rows)
    assert len(rows) >= 24
    ticks = [r[0] for r in rows]
    assert len(set(ticks)) == len(ticks), "a tick fired twice"
    for before, after in zip(rows, rows[1:]):
        assert after[1] == before[0], f"fire {after[0]} does not follow {before[0]}"
    span = int((ticks[-1] - ticks[0]).total_seconds())
    coalesced = sum(r[2] for r in rows[1:])
    assert sum(1 + r[2] for r in rows[1:]) == span, "every second of the window is fired or coalesced once"
    assert all(t.microsecond == 0 for t in ticks)
    # each fire enqueued exactly one job (the audit trigger saw every ready row ever written)
    jobs = [int(r[3]) for r in rows]
    assert None not in jobs and len(set(jobs)) == len(jobs)
    first_rows = q(obs, f'SELECT job_id, count(*) FROM "{schema}_audit".enqueued WHERE job_id = ANY(%s) '
                        "GROUP BY job_id", (jobs,))
    assert {int(j) for j, _ in first_rows} == set(jobs)
    terminal = q(obs, f'SELECT job_id, count(*) FROM "{schema}_audit".terminal WHERE job_id = ANY(%s) '
                      "GROUP BY job_id", (jobs,))
    assert len(terminal) == len(jobs) and all(n == 1 for _, n in terminal), "one terminal record per job"
    ticks_in_jobs = q(obs, f"""SELECT e.metadata->>'awa.tick' FROM "{schema}".ready_entries e
                             WHERE e.kind = 'cron.tick' AND e.lease_base = 0 AND e.job_id = ANY(%s)""", (jobs,))
    assert len(ticks_in_jobs) == len(set(ticks_in_jobs))
    assert len(kills) == 2
    assert coalesced >= 2, "the frozen leader's missed ticks were coalesced"
    record_figures("cron_failover", fires=len(rows), window_s=span, coalesced_ticks=coalesced,
                   takeover_s=kills)
