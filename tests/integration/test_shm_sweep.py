"""A supervisor killed with SIGKILL leaks its /dev/shm segment; the next one to start removes it.

``kill -9`` of the whole process group takes the resource tracker with it,
so nothing unlinks the dead supervisor's segment. A new ``awa-fast
supervise`` sweeps segments whose owner is provably dead (logged at INFO)
and leaves a live process's segment alone.
"""

from __future__ import annotations

import pathlib
import re
import signal
import time

import pytest

from awa_fast.runtime import shm
from awa_fast.runtime.shm import ShmRing
from tests.fixtures.supervisor import SupervisorProc, group_gone
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import QUEUE

pytestmark = pytest.mark.integration

DEV_SHM = pathlib.Path("/dev/shm")
SPEC = [f"{QUEUE}:stripes=1,concurrency=4"]
RETRY_FOR = 30.0  # seconds of rounds lost to another sweeper before giving up


def _leak_one(pg_dsn: str, schema: str, tmp_path: pathlib.Path, tag: str) -> tuple[str, int]:
    """Run a supervisor, SIGKILL its whole group; (its segment name, its pid)."""
    with SupervisorProc(pg_dsn, schema, tmp_path, name=f"killed{tag}", queues=SPEC) as killed:
        killed.wait_running(1)
        name = wait_for(lambda: (killed.local_status() or {}).get("name"), 10, "the segment name",
                        on_timeout=killed.tail)
        owner = shm.segment_owner(name)
        assert owner is not None and owner[0] == killed.pid, name
        killed.kill_group(signal.SIGKILL)
        killed.wait(10)
        wait_for(lambda: group_gone(killed.pid), 10, "the killed group (resource tracker too) to be gone")
    return name, killed.pid


def test_next_supervisor_sweeps_the_segment_of_a_group_killed_with_sigkill(pg_dsn, schema, tmp_path):
    live = ShmRing.create(None, [(QUEUE, 0)])  # owned by this (live) process: never swept
    try:
        # Any supervisor starting on this host sweeps (a parallel test run, say): if one
        # removes our leaked segment before ours can, the round proves nothing; repeat it.
        deadline = time.monotonic() + RETRY_FOR
        rnd = 0
        while True:
            rnd += 1
            leaked, dead_pid = _leak_one(pg_dsn, schema, tmp_path, str(rnd))
            if not (DEV_SHM / leaked).exists():  # swept by someone else (never happens without a sweep)
                assert time.monotonic() < deadline, f"for {RETRY_FOR}s others always swept our leak first"
                continue
            with SupervisorProc(pg_dsn, schema, tmp_path, name=f"next{rnd}", queues=SPEC) as nxt:
                nxt.wait_running(1)
                assert not (DEV_SHM / leaked).exists(), f"{leaked} survived the next start\n{nxt.tail()}"
                assert (DEV_SHM / live.name).exists()
                own = nxt.local_status()  # `status` still finds the new supervisor's segment
                assert own is not None and own["supervisor_pid"] == nxt.pid and (DEV_SHM / own["name"]).exists()
                swept_here = re.search(rf" INFO awa_fast\.shm\[{nxt.pid}\]: removed shared-memory segment "
                                       rf"{leaked} left by dead supervisor {dead_pid} ", nxt.output())
                assert nxt.stop() == 0, nxt.tail()
            assert not (DEV_SHM / own["name"]).exists()  # a clean stop still unlinks its own
            if swept_here:
                break
            assert time.monotonic() < deadline, f"for {RETRY_FOR}s others always swept our leak first\n{nxt.tail()}"
        assert (DEV_SHM / live.name).exists()
    finally:
        live.close()
        live.unlink()
