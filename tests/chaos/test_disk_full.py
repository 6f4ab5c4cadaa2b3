"""Disk full: the queue's tables live on a 24 MB tmpfs (a tablespace in a private mount namespace).

A filler table takes the last byte; enqueues, claims, heartbeats and
completions hit ENOSPC (SQLSTATE 53100) for a few seconds; then the filler is
dropped. Promises: a failed enqueue is not visible, no committed job is lost
or finished twice, and the queue drains by itself once space is back.
WAL stays on the normal disk: a full WAL volume is a PANIC and a restart,
which test_server_chaos.py covers with an immediate crash.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time

import psycopg
import pytest

from awa_fast.embedded import PostgresCluster
from tests.chaos.chaos_helpers import (
    CLUSTER_SETTINGS,
    ROOT,
    ChaosCluster,
    Expect,
    Producer,
    Supervise,
    _bindir,
    check_invariants,
    check_live,
    copy_template,
    enqueue_many,
    free_port,
    new_schema,
    record_figures,
    supervisors,
    terminal_count,
    wait_terminal,
)
from tests.fixtures.waiting import wait_for

TMPFS_SIZE = "24m"


@pytest.fixture(scope="module")
def pg_full(tmp_path_factory):
    if shutil.which("unshare") is None or shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("needs root, unshare and mount for a private tmpfs")
    root = tmp_path_factory.mktemp("pg-full")
    datadir, ts = root / "data", root / "ts"
    copy_template(datadir)
    ts.mkdir(mode=0o700)
    port = free_port()
    settings = {**CLUSTER_SETTINGS, "port": str(port)}
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "--", sys.executable, "-m",
                          "tests.chaos.chaos_mountns", str(datadir), str(_bindir()), str(ts), TMPFS_SIZE,
                          json.dumps(settings)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        pytest.skip(f"cannot start a cluster in a private mount namespace: {out.stderr[-500:]}")
    cc = ChaosCluster(PostgresCluster(datadir, _bindir(), settings=settings), port)
    with cc.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        c.execute(f"CREATE TABLESPACE chaos_small LOCATION '{ts}'")
        c.execute("ALTER DATABASE postgres SET default_tablespace = chaos_small")
    yield cc
    cc.stop()


def _fill(conn: psycopg.Connection) -> int:
    """Insert into a filler table on the small tablespace until ENOSPC; returns the rows that fit."""
    conn.execute("CREATE TABLE chaos_filler (i int, pad text) TABLESPACE chaos_small")
    rows = 0
    while True:
        try:
            conn.execute("INSERT INTO chaos_filler SELECT g, md5(g::text) || md5(random()::text) "
                         "FROM generate_series(1, 20000) g")
            rows += 20000
        except psycopg.errors.DiskFull:
            return rows


@pytest.mark.slow
def test_tablespace_disk_full_then_space_back(pg_full, tmp_path):
    pg = pg_full
    schema = new_schema(pg.dsn, "full")
    obs = pg.connect()
    n = 3000
    enqueue_many(pg.dsn, schema, n, {"sleep": 0.01})
    sup = Supervise(pg.dsn, schema, tmp_path, stripes=2, concurrency=8)
    # 1.5 KB of incompressible args (stored inline): ready pages fill fast, so enqueue needs new
    # pages within a second of the disk filling up
    producer = Producer(pg.dsn, schema, rate=50, prefix="full", args={"pad": secrets.token_hex(750)})
    try:
        with supervisors(sup.start()):
            producer.start()
            wait_for(lambda: terminal_count(obs, schema) > 100, 20, "100 completions")
            filler_rows = _fill(obs)
            t_full = time.monotonic()
            errors_before = len(producer.errors)
            wait_for(lambda: len(producer.errors) >= errors_before + 3, 20, "enqueues failing with ENOSPC")
            stalled_at = terminal_count(obs, schema)
            time.sleep(2.0)  # the disk stays full for two more seconds (a duration)
            obs.execute("DROP TABLE chaos_filler")
            t_free = time.monotonic()
            full_for = t_free - t_full
            base = terminal_count(obs, schema)
            wait_for(lambda: terminal_count(obs, schema) > base, 20, "progress once space is back")
            t_progress = time.monotonic() - t_free
            time.sleep(0.5)  # the producer enqueues a little more after the recovery
            producer.stop()
            acked, doubt = producer.committed_tokens(obs)
            total = n + acked + doubt
            wait_terminal(obs, schema, total, 60)
            t_all = time.monotonic() - t_free
            check_live(obs, schema)
            assert sup.stop() == 0, sup.log()[-3000:]
        figures = check_invariants(obs, schema, Expect(total, {"completed": total}), sup.exec_log,
                                   sup.stale_rejected(), supervisors_stopped=True)
    finally:
        producer.stop()
        obs.close()
    assert t_progress < 10.0, t_progress
    enospc = sup.log().count("No space left") + sup.log().count("could not extend")
    record_figures("disk_full_tablespace", tmpfs=TMPFS_SIZE, filler_rows=filler_rows, full_for_s=round(full_for, 2),
                   completed_when_full=stalled_at, progress_after_space_back_s=round(t_progress, 2),
                   all_done_after_space_back_s=round(t_all, 2), enqueue_errors=len(producer.errors),
                   enqueues_in_doubt=len(producer.in_doubt), in_doubt_committed=doubt,
                   enospc_lines_in_worker_log=enospc, child_restarts=sup.log().count("restarting in"), **figures)
