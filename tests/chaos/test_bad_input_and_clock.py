"""Bad input from handlers, secrets in DSNs, and clocks.

- Handlers that raise with NUL bytes, lone surrogates, a 5 MB message, an
  exception whose ``__str__`` fails, or return garbage: every attempt still
  closes (here: to the DLQ, max_attempts=1), no other job is affected.
- A DSN password never appears in the supervisor's output, also when the
  database is unreachable.
- Clock: there is no libfaketime here, so a claimer cannot run with a
  shifted process clock. Instead: (1) the SQL is checked so that no rescue,
  deadline, heartbeat or lease comparison can use a client-supplied time,
  and (2) a supervisor runs with an odd ``TZ`` and ``PGTZ`` (session time
  zone) through delays, a deadline rescue and completions.
"""

from __future__ import annotations

import datetime as dt
import pathlib
import re
import subprocess
import sys

import psycopg
import pytest

from tests.chaos.chaos_helpers import (
    QUEUE,
    ROOT,
    Expect,
    Supervise,
    check_invariants,
    drop_schema,
    enqueue_many,
    enqueue_one,
    free_port,
    new_schema,
    q,
    record_figures,
    supervisors,
    wait_terminal,
)

SECRET = "Pa55-w0rd-chaos"
BAD_MODES = ["raise_nul", "raise_big", "terminal_nul", "raise_unprintable", "garbage", "garbage_int"]


def _run_bad_handlers(pg, obs, tmp_path, modes: list[str], kind: str) -> dict:
    schema = new_schema(pg.dsn, "bad")
    try:
        good = 50
        enqueue_many(pg.dsn, schema, good, {"sleep": 0.001}, kind=kind)
        for mode in modes:
            enqueue_one(obs, schema, {"mode": mode}, kind=kind, max_attempts=1)
        # the cluster's real password (TCP is SCRAM, never trust): it must never be logged
        secret = pg.password
        sup = Supervise(f"{pg.dsn} password={secret}", schema, tmp_path, stripes=1, concurrency=4)
        total = good + len(modes)
        with supervisors(sup.start()):
            try:
                wait_terminal(obs, schema, total, 20, "every job, bad or good, to end")
            finally:
                states = dict(q(obs, f'SELECT state, count(*) FROM "{schema}_audit".terminal GROUP BY 1'))
                open_attempts = q(obs, f"""SELECT e.args->>'mode', count(*) FROM "{schema}_audit".claims c
                    JOIN "{schema}".ready_entries e ON e.job_id = c.job_id
                    WHERE NOT EXISTS (SELECT 1 FROM "{schema}_audit".terminal t WHERE t.job_id = c.job_id)
                    GROUP BY 1""")
                record_figures(f"bad_handlers_{kind}", terminal_by_state=states, still_open_by_mode=open_attempts)
            assert sup.stop() == 0, sup.log()[-3000:]
        assert secret not in sup.log(since_start=False)
        figures = check_invariants(obs, schema, Expect(total, {"completed": good, "dlq": len(modes)}),
                                   sup.exec_log, sup.stale_rejected(), supervisors_stopped=True)
        reasons = q(obs, f'SELECT reason FROM "{schema}".dlq_entries')
        assert len(reasons) == len(modes)
        for (reason,) in reasons:
            assert reason and "\x00" not in reason and len(reason) <= 8192, reason[:200]
        nul = [r for (r,) in reasons if "bad \\x00 byte" in r or "terminal \\x00" in r]
        assert len(nul) == sum(1 for m in modes if "nul" in m), reasons
        return figures
    finally:
        drop_schema(pg.dsn, schema)


# Found here (both fixed in 49f8cf8): the receipt_lock query's unescaped '%' made every flush with a
# retry/fail/cancel/snooze outcome fail, so outcomes were dropped and attempts rescued instead; and an
# exception whose __str__ raises killed the worker thread, leaving its attempt open and heartbeated.
@pytest.mark.parametrize("kind", ["chaos.work", "chaos.async"])
def test_bad_handler_outcomes_close_the_attempt_with_a_clean_error(pg, obs, tmp_path, kind):
    figures = _run_bad_handlers(pg, obs, tmp_path, BAD_MODES, kind)
    record_figures(f"bad_handlers_{kind}", **figures)


@pytest.mark.parametrize("dsn", [
    "host=127.0.0.1 port={port} user=postgres dbname=postgres password={secret} connect_timeout=2",
    "postgresql://postgres:{secret}@127.0.0.1:{port}/postgres?connect_timeout=2",
])
def test_dsn_password_never_printed_when_unreachable(dsn, tmp_path):
    dsn = dsn.format(port=free_port(), secret=SECRET)
    out = subprocess.run([sys.executable, "-m", "awa_fast.cli", "--log-level", "DEBUG", "supervise",
                          "tests.chaos.chaos_app:app", "--schema", "nowhere", "--dsn", dsn, "--queue", QUEUE,
                          "--home", str(tmp_path / "home")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
    assert SECRET not in out.stdout + out.stderr
    assert "***" in out.stderr or "127.0.0.1" in out.stderr, out.stderr[-500:]


# -- clock -------------------------------------------------------------------------------------


def _function_params(sql_dir: pathlib.Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for f in sorted(sql_dir.glob("*.sql")):
        text = f.read_text()
        for m in re.finditer(r"CREATE (?:OR REPLACE )?FUNCTION\s+__SCHEMA__\.(\w+)\s*\(", text):
            i = j = m.end()
            depth = 1
            while depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            out[m.group(1)] = re.sub(r"\s+", " ", text[i:j - 1])
    return out


def test_no_time_comparison_uses_a_client_supplied_time():
    sql_dir = ROOT / "sql"
    params = _function_params(sql_dir)
    timed = {name: p for name, p in params.items() if re.search(r"timestamp|interval|\bdate\b|\btime\b", p, re.I)}
    # the only timestamps a function takes: a job's run_at (when the user wants it to run, compared
    # with now()), also through the unique enqueue (job_enqueue_unique -> job_write), the flat single
    # enqueue (job_enqueue_v2, job_enqueue_v3) and the keyed one (job_enqueue_keyed: greatest(run_at, now())); a job's
    # created_at copied from an earlier row by ready_append (never compared); and a periodic
    # schedule's tick and previous tick (schedule_fire): ledger keys the evaluator computed from
    # the cron expression and the database clock it read (schedule_due_list's now()), compared
    # with now() only to refuse a tick that is not due yet; a unique key's stored expires_at
    # (unique_holds, read from the key row) and the fire ledger's retention interval
    # (schedule_fires_prune: now() - keep), neither of them a clock reading; the _v2 of the unique
    # and periodic ones (migration 0015) take the same arguments and differ only in the done rows they read
    assert set(timed) <= {"job_enqueue", "job_enqueue_v2", "job_enqueue_v3", "job_enqueue_keyed", "ready_append",
                          "job_enqueue_unique", "job_write", "schedule_fire", "unique_holds",
                          "schedule_fires_prune", "job_enqueue_unique_v2", "schedule_fire_v2",
                          "unique_holds_v2"}, timed
    queries = (sql_dir / "queries.sql").read_text()
    timed_queries = {name for name, body in re.findall(r"^-- name: (\w+)\n(.*?)(?=^-- name:|\Z)", queries,
                                                         re.M | re.S)
                     if re.search(r"%s::(?:timestamptz|timestamp|interval|date)\b", body)}
    assert timed_queries == {"job_enqueue", "job_enqueue_keyed", "job_enqueue_unique", "schedule_fire"}, timed_queries
    assert "ready_append" not in queries  # only ever called from SQL with stored values
    # rescue, deadlines, heartbeats, callbacks and retention compare against now() only
    body = (sql_dir / "0002_storage_functions.sql").read_text()
    for fn in ("receipt_rescue_stale", "lease_rescue_expired", "dlq_retention_prune", "attempt_state_sweep"):
        assert re.search(rf"FUNCTION __SCHEMA__\.{fn}\(p_limit int\)|FUNCTION __SCHEMA__\.{fn}\(\)", body), fn
    # the Python side never sends its own clock to SQL
    for path in sorted((ROOT / "awa_fast" / "storage").glob("*.py")):
        assert not re.search(r"time\.time\(\)|datetime\.now|utcnow|monotonic", path.read_text()), path


def test_odd_timezones_delays_and_deadline_rescue(pg, obs, tmp_path):
    """TZ=+14h for the processes, PGTZ=-3:30 for their sessions: delays, deadlines and rescue still hold.

    The job that must be rescued holds on a gate the test opens only once its
    DLQ record exists, so it outlasts its deadline however slow the machine:
    it cannot complete first. The deadline (3 s) is above the heartbeat
    timeout (2 s), so the 1 ms jobs are no nearer a rescue than in any other
    scenario; each rescue is checked to come at least a deadline after its
    claim on the database clock (a time zone mix-up would be hours off).
    """
    deadline = 3.0
    schema = new_schema(pg.dsn, "tz", deadline=deadline)
    gate = tmp_path / "release-the-slow-job"
    try:
        n = 100
        enqueue_many(pg.dsn, schema, n, {"sleep": 0.001})
        with psycopg.connect(pg.dsn, autocommit=True, application_name="chaos:producer") as c:
            c.execute("SET TimeZone = 'Asia/Kathmandu'")
            delayed = [enqueue_one(c, schema, {"d": i}, delay=1.5) for i in range(3)]
            at = dt.datetime.now(dt.timezone(dt.timedelta(hours=-9, minutes=-30))) + dt.timedelta(seconds=1.5)
            delayed += [enqueue_one(c, schema, {"run_at": 1}, run_at=at)]
            # held past its deadline twice: rescued twice, then DLQ (max_attempts=2)
            slow = enqueue_one(c, schema, {"hold": str(gate)}, max_attempts=2)
        env = {"TZ": "Pacific/Kiritimati", "PGTZ": "America/St_Johns"}
        sup = Supervise(pg.dsn, schema, tmp_path, stripes=2, concurrency=4, extra_env=env)
        total = n + len(delayed) + 1
        with supervisors(sup.start()):
            try:
                wait_terminal(obs, schema, total, 60)
            finally:
                gate.touch()  # the held handlers return; their outcomes are stale by now
            assert sup.stop() == 0, sup.log()[-3000:]
        figures = check_invariants(obs, schema, Expect(total, {"completed": total - 1, "dlq": 1}), sup.exec_log,
                                   sup.stale_rejected(), supervisors_stopped=True)
        # no delayed job ran before its time (database clock on both sides)
        early = q(obs, f"""SELECT c.job_id, extract(epoch FROM c.at - e.at)::float8 FROM "{schema}_audit".claims c
                           JOIN (SELECT job_id, min(at) AS at FROM "{schema}_audit".enqueued GROUP BY 1) e
                             ON e.job_id = c.job_id
                           WHERE c.job_id = ANY(%s) AND c.at < e.at + interval '1.4 seconds'""", (delayed,))
        assert len(q(obs, f'SELECT DISTINCT job_id FROM "{schema}_audit".claims WHERE job_id = ANY(%s)',
                     (delayed,))) == len(delayed)
        assert not early, early
        [(reason, attempt)] = q(obs, f'SELECT reason, attempt FROM "{schema}".dlq_entries WHERE job_id = %s',
                                (slow,))
        assert "deadline exceeded" in reason and attempt == 2, (reason, attempt)
        # the slow job's two attempts were rescued (its DLQ record above says so) and both ran (they
        # hold on the gate). On a loaded machine a 1 ms job can outlast its heartbeat timeout too and
        # be rescued once more, either while it runs or while it is still held unstarted in its
        # claimer, which then never starts it under that lease (a drain hands it back): no rescued
        # attempt ran twice, and check_invariants has already proved each job completed once
        assert figures["rescued_attempts"] >= 2, figures
        assert 2 <= figures["executions_of_rescued_attempts"] <= figures["rescued_attempts"], figures
        # each rescue came a deadline after its claim (database clock; the audit stamps the claim a few
        # ms after the claim's own now(), from which deadline_at counts: hence the 0.2 s)
        waited = q(obs, f"""SELECT x.run_lease, extract(epoch FROM x.at - c.at)::float8
                            FROM "{schema}_audit".closures x JOIN "{schema}_audit".claims c
                              ON c.job_id = x.job_id AND c.run_lease = x.run_lease
                            WHERE x.job_id = %s AND x.outcome = 7 ORDER BY 1""", (slow,))
        assert len(waited) == 2 and all(w >= deadline - 0.2 for _, w in waited), waited
        record_figures("odd_timezones", rescued_after_s=[round(w, 2) for _, w in waited], **figures)
    finally:
        gate.touch()
        drop_schema(pg.dsn, schema)
