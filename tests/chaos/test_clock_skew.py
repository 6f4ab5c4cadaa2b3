"""Chaos scenario 8: clock skew injected into the workers (+-1 h).

There is no libfaketime here, so ``clock_shift.c`` (next to this file) is
compiled at test time into an ``LD_PRELOAD`` shim that shifts
``CLOCK_REALTIME``/``CLOCK_REALTIME_COARSE`` (``clock_gettime``),
``gettimeofday`` and ``time`` by ``$AWA_FAST_CLOCK_SHIFT_S`` seconds; every
other clock (monotonic, TAI, ...) passes through. The supervisor, its
claimers and its maintenance process run under it; the database and this
test do not.

Proved: (1) the shim shifts exactly the wall clock of a process; (2) the
skewed processes really run shifted (their shared-memory liveness stamps,
read here, are off by the shift); (3) with the shift, healthy jobs that
live past the heartbeat timeout are never rescued (every claim is
run_lease 1, no stale outcome but the one expected), heartbeats land at
the database's ``now()`` (never in its future, never older than the
timeout), a queue deadline rescues an overdue job after the deadline by the
database clock (not before, not an hour late), and jobs delayed by
``run_at`` or ``delay`` are claimed no earlier than their stored
``run_at``. A lease, deadline or heartbeat comparison made with the
worker's clock would fail one of these: -1 h makes every attempt look an
hour old (rescues, an immediate deadline), +1 h puts heartbeats in the
future and the deadline an hour away, and either makes delays early or
late by an hour.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter

import psycopg
import pytest

from awa_fast.runtime.shm import ShmRing, read_locator
from awa_fast.runtime.status import latency_summary
from tests.chaos.chaos_helpers import (
    Expect,
    Supervise,
    check_invariants,
    drop_schema,
    enqueue_many,
    enqueue_one,
    new_schema,
    open_claims,
    q,
    read_exec_log,
    record_figures,
    scalar,
    supervisors,
    terminal_count,
)
from tests.fixtures.waiting import wait_for

SHIM_SRC = pathlib.Path(__file__).with_name("clock_shift.c")
SHIFT_ENV = "AWA_FAST_CLOCK_SHIFT_S"
CLOCK_REALTIME_COARSE = 5  # Linux; the time module does not name it

HB_TIMEOUT = 2.0  # queue heartbeat_timeout; Supervise heartbeats every 0.5 s and rescues every 0.5 s
DEADLINE = 4.0  # queue deadline: above every healthy job's run time, below the overdue job's
LONG_SLEEP = 2.5  # healthy jobs that outlive the heartbeat timeout: only heartbeats keep them
OVERDUE_SLEEP = 9.0  # well past the deadline: rescued once (max_attempts=1, so to the DLQ), then stale
DELAY = 3.0
LATE_BOUND = 4.5  # rescue and promotion run every 0.5/0.25 s; seconds more on a loaded 2-core box
N_LONG, N_QUICK = 6, 300


def _compiler() -> list[str] | None:
    if os.environ.get("CC"):
        argv = shlex.split(os.environ["CC"])
        if argv and shutil.which(argv[0]):
            return argv
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> pathlib.Path:
    """clock_shift.c built into a shared object for LD_PRELOAD."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler ($CC, cc, gcc or clang) to build the clock-shift LD_PRELOAD shim")
    out = tmp_path_factory.mktemp("clock-shift") / "clock_shift.so"
    r = subprocess.run([*cc, "-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-o", str(out),
                        str(SHIM_SRC), "-ldl"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and out.exists(), f"building the shim failed:\n{r.stdout}{r.stderr}"
    return out


_PROBE = f"""
import ctypes, datetime, json, time
class TV(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("us", ctypes.c_long)]
libc = ctypes.CDLL(None)
libc.time.restype = ctypes.c_long
tv = TV()
assert libc.gettimeofday(ctypes.byref(tv), None) == 0
print(json.dumps({{"time": time.time(), "coarse": time.clock_gettime({CLOCK_REALTIME_COARSE}),
                  "datetime": datetime.datetime.now().timestamp(), "gettimeofday": tv.s + tv.us / 1e6,
                  "c_time": libc.time(None), "tai": time.clock_gettime(time.CLOCK_TAI),
                  "monotonic": time.monotonic()}}))
"""


@pytest.mark.parametrize("shift", [3600.0, -3600.0, -0.75])
def test_shim_shifts_only_the_wall_clock(shim, shift):
    env = {**os.environ, "LD_PRELOAD": str(shim), SHIFT_ENV: repr(shift)}
    t0, tai0, m0 = time.time(), time.clock_gettime(time.CLOCK_TAI), time.monotonic()
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=30)
    t1, tai1, m1 = time.time(), time.clock_gettime(time.CLOCK_TAI), time.monotonic()
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    slack = 0.01  # the coarse clock ticks every few ms
    for key in ("time", "coarse", "datetime", "gettimeofday"):
        assert t0 + shift - slack <= got[key] <= t1 + shift + slack, (key, got[key] - t0, shift)
    assert int(t0 + shift) - 1 <= got["c_time"] <= int(t1 + shift) + 1, (got["c_time"] - t0, shift)
    # every other clock id passes through
    assert tai0 <= got["tai"] <= tai1 and m0 <= got["monotonic"] <= m1, (got, tai0, tai1, m0, m1)


def _open_attempt_ages(conn: psycopg.Connection, schema: str) -> list[tuple[int, float]]:
    """(job_id, seconds since the last heartbeat, or the claim if none yet) of open attempts."""
    return [(j, age) for j, _, age in open_claims(conn, schema, clock="clock_timestamp()")]


def _shm_snapshot(home: pathlib.Path, schema: str) -> dict:
    """The running supervisor's shared-memory snapshot (what ``awa-fast status`` reads), errors raised."""
    found = read_locator(home, schema)
    assert found is not None, f"no live supervisor in the locator {list((home / 'run').glob('*'))}"
    ring = ShmRing.attach(found[0])
    try:
        return ring.snapshot()
    finally:
        ring.close()


@pytest.mark.parametrize("shift", [3600, -3600], ids=["plus_1h", "minus_1h"])
def test_skewed_workers_use_the_database_clock(pg, obs, tmp_path, shim, shift):
    schema = new_schema(pg.dsn, "skew", heartbeat_timeout=HB_TIMEOUT, deadline=DEADLINE)
    a = f'"{schema}_audit"'
    try:
        sup = Supervise(pg.dsn, schema, tmp_path, stripes=2, concurrency=8,
                        extra_env={"LD_PRELOAD": str(shim), SHIFT_ENV: str(shift)})
        with supervisors(sup.start()):
            # everything is enqueued while the skewed workers run (the producer's clock is the real one)
            with psycopg.connect(pg.dsn, autocommit=True, application_name="chaos:producer") as c:
                long_ids = [enqueue_one(c, schema, {"sleep": LONG_SLEEP, "long": i}) for i in range(N_LONG)]
                overdue = enqueue_one(c, schema, {"sleep": OVERDUE_SLEEP, "overdue": 1}, max_attempts=1)
                db_now = scalar(c, "SELECT clock_timestamp()")
                delayed = [enqueue_one(c, schema, {"run_at": 1}, run_at=db_now + dt.timedelta(seconds=DELAY)),
                           enqueue_one(c, schema, {"delay": 1}, delay=DELAY)]
            run_at = dict(q(obs, f'SELECT job_id, run_at FROM "{schema}".deferred_jobs WHERE job_id = ANY(%s)',
                            (delayed,)))
            assert set(run_at) == set(delayed), run_at
            enqueue_many(pg.dsn, schema, N_QUICK, {"sleep": 0.001})
            total = N_LONG + 1 + len(delayed) + N_QUICK

            hb_ages: list[float] = []  # of healthy open attempts, sampled while waiting

            def all_ended() -> bool:
                hb_ages.extend(age for j, age in _open_attempt_ages(obs, schema) if j != overdue)
                return terminal_count(obs, schema) >= total

            wait_for(all_ended, 30, f"all {total} jobs to end", interval=0.05)

            # the workers really run shifted: their liveness stamps in shared memory are off by the shift
            local = _shm_snapshot(tmp_path / "home", schema)
            now = time.time()
            offsets = [c["last_alive"] - now for c in local["claimers"]]
            offsets.append(local["maintenance"]["last_tick"] - now)
            assert len(offsets) == 3 and all(abs(o - shift) < 30 for o in offsets), (shift, offsets)
            latency = latency_summary(local)
            # drain: the overdue handler still sleeps; its late outcome is rejected as stale
            assert sup.stop() == 0, sup.log()[-3000:]

        stale = sup.stale_rejected()
        figures = check_invariants(obs, schema, Expect(total, {"completed": total - 1, "dlq": 1}), sup.exec_log,
                                   stale, supervisors_stopped=True)

        # no extra rescue: the one rescue is the overdue job's deadline; every claim is lease 1
        rescued = q(obs, f"SELECT job_id, run_lease FROM {a}.closures WHERE outcome = 7")
        assert rescued == [(overdue, 1)], rescued
        assert q(obs, f"SELECT job_id, run_lease FROM {a}.claims WHERE run_lease <> 1") == []
        assert stale == 1, sup.log()[-3000:]
        starts = Counter((e.job_id, e.run_lease) for e in read_exec_log(sup.exec_log) if e.what == "start")
        ends = Counter((e.job_id, e.run_lease) for e in read_exec_log(sup.exec_log) if e.what == "end")
        assert len(starts) == total and set(starts.values()) == {1} and ends == starts, (len(starts), total)

        # latency metrics are on the database clock too (the claimer measures its clock offset):
        # a skewed worker would read ~3,600,000 ms (clamped at the top bucket) or land in bucket 0
        for which in ("pickup", "e2e"):
            p50 = latency[which].get("p50")
            assert p50 is not None and 0.1 <= p50 <= 10_000, (which, latency)

        # heartbeats are stamped by the database: never in its future, never older than the timeout
        assert hb_ages, "no open attempt was ever sampled"
        assert min(hb_ages) >= -0.01 and max(hb_ages) < HB_TIMEOUT, (min(hb_ages), max(hb_ages))
        # and they kept alive attempts that outlived the timeout (database clock on both sides)
        lived = [float(x) for (x,) in q(obs, f"""
            SELECT extract(epoch FROM t.at - c.at)::float8 FROM {a}.claims c JOIN {a}.terminal t USING (job_id)
            WHERE c.job_id = ANY(%s)""", (long_ids,))]
        assert len(lived) == N_LONG and min(lived) > HB_TIMEOUT, lived

        # the deadline fires by the database clock: after DEADLINE, not an hour early or late
        [(rescue_after,)] = q(obs, f"""SELECT extract(epoch FROM x.at - c.at)::float8 FROM {a}.closures x
                                       JOIN {a}.claims c USING (job_id, run_lease)
                                       WHERE x.job_id = %s AND x.outcome = 7""", (overdue,))
        assert DEADLINE - 0.1 <= rescue_after <= DEADLINE + LATE_BOUND, rescue_after
        [(reason, attempt)] = q(obs, f'SELECT reason, attempt FROM "{schema}".dlq_entries WHERE job_id = %s',
                                (overdue,))
        assert "deadline exceeded" in reason and attempt == 1, (reason, attempt)

        # delayed jobs ran no earlier than their stored run_at (and not an hour late)
        claimed_at = dict(q(obs, f"SELECT job_id, min(at) FROM {a}.claims WHERE job_id = ANY(%s) GROUP BY 1",
                            (delayed,)))
        lateness = {j: (claimed_at[j] - run_at[j]).total_seconds() for j in delayed}
        assert all(0.0 <= s <= LATE_BOUND for s in lateness.values()), lateness

        record_figures("clock_skew", shift_s=shift, worker_clock_offset_s=[round(o, 2) for o in offsets],
                       jobs=total, rescued=rescued, stale_rejected=stale,
                       heartbeat_age_max_s=round(max(hb_ages), 3), long_job_lived_min_s=round(min(lived), 3),
                       deadline_rescue_after_s=round(rescue_after, 3),
                       delayed_lateness_s=sorted(round(s, 3) for s in lateness.values()),
                       claimer_pickup_ms=latency["pickup"], **figures)
    finally:
        drop_schema(pg.dsn, schema)
