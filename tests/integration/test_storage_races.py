"""Concurrent interleavings of one attempt's writers and of maintenance with traffic.

- completion racing rescue: exactly one wins per attempt, the loser is stale;
- cancel racing claimers: a job reported 'cancelled' is never handed out;
- two promoters: every due job is promoted exactly once;
- rotation and prune running against live claim/complete traffic never lose
  or double-count a job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from awa_fast.client import Client
from awa_fast.jobs import ClaimSnapshot
from awa_fast.storage import Storage
from tests.fixtures.database import connect, sqlx
from tests.integration.storage_helpers import DONE_ALL, claim, counts, make_due

Q = "q"


def run_threads(targets: list[Callable[[], None]], timeout: float = 60) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert errors == [], errors


@pytest.mark.parametrize("path", ["copy", "rows"])
def test_completion_racing_rescue_has_exactly_one_winner_per_attempt(pg_dsn, schema, storage, conn, path):
    total = 400
    storage.queue_configure(conn, Q, heartbeat_timeout=0)
    Client(None, schema).enqueue_many("k", [{"i": i} for i in range(total)], queue=Q, conn=conn)
    snaps = claim(storage, conn, Q, total)
    assert len(snaps) == total
    stale: list[tuple[int, int]] = []
    rescued = [0]
    first_rescue = threading.Event()  # the completer starts once rescues are under way

    def completer() -> None:
        with connect(pg_dsn, schema, tag="completer") as c:
            st = Storage(schema)
            first_rescue.wait(30)
            for i in range(0, total, 4):
                if path == "rows":  # one statement in autocommit
                    stale.extend(st.receipt_complete_rows(c, snaps[i:i + 4]))
                    continue
                with c.transaction():
                    stale.extend(st.receipt_complete(c, snaps[i:i + 4]))

    def rescuer() -> None:
        with connect(pg_dsn, schema, tag="rescuer") as c:
            st = Storage(schema)
            try:
                for _ in range(400):
                    rescued[0] += st.receipt_rescue_stale(c, 5)
                    first_rescue.set()
                    if counts(st, c, Q).get("running", 0) == 0:
                        return
            finally:
                first_rescue.set()

    run_threads([completer, rescuer])
    stale_jobs = {j for j, _ in stale}
    rescued_jobs = {int(r[0]) for r in sqlx(conn, schema, "SELECT job_id FROM __SCHEMA__.lease_claim_closures "
                                                          "WHERE outcome = 7").fetchall()}
    done_jobs = {int(r[0]) for r in sqlx(conn, schema, f"SELECT job_id FROM {DONE_ALL} "
                                                       "WHERE run_lease = 1").fetchall()}
    assert rescued[0] == len(rescued_jobs)
    assert rescued_jobs and done_jobs, "no race happened"
    assert stale_jobs == rescued_jobs  # the loser of each race is told it is stale
    assert done_jobs.isdisjoint(rescued_jobs)  # a rescued attempt never also completes
    assert done_jobs | rescued_jobs == {s.job_id for s in snaps}
    assert counts(storage, conn, Q) == {k: v for k, v in
                                        {"completed": len(done_jobs), "available": len(rescued_jobs)}.items() if v}
    again = claim(storage, conn, Q, total)
    assert {s.job_id for s in again} == rescued_jobs
    assert all(s.run_lease == 2 for s in again)


def test_cancel_racing_claimers_never_hands_out_a_cancelled_job(pg_dsn, schema, storage, conn):
    total = 3000
    Client(None, schema).enqueue_many("k", [{"i": i} for i in range(total)], queue=Q, conn=conn)
    job_ids = [int(r[0]) for r in sqlx(conn, schema, "SELECT job_id FROM __SCHEMA__.ready_entries "
                                                     "ORDER BY lane_seq").fetchall()]
    claimed: list[ClaimSnapshot] = []
    results: dict[int, str] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def claimer(k: int) -> Callable[[], None]:
        def run() -> None:
            with connect(pg_dsn, schema, tag=f"claimer{k}") as c:
                st = Storage(schema)
                idle_since = None
                while True:
                    snaps = st.lane_claim(c, Q, 20)
                    if snaps:
                        idle_since = None
                        with lock:
                            claimed.extend(snaps)
                        with c.transaction():
                            st.receipt_complete(c, snaps)
                    elif stop.is_set():
                        if idle_since is None:
                            idle_since = time.monotonic()
                        elif time.monotonic() - idle_since > 0.2:
                            return
        return run

    def canceller() -> None:
        try:
            with connect(pg_dsn, schema, tag="canceller") as c:
                st = Storage(schema)
                for j in reversed(job_ids[::3]):  # from the back: cancels meet the claim frontier
                    results[j] = st.job_cancel(c, j)
        finally:
            stop.set()

    run_threads([claimer(0), claimer(1), canceller])
    handed_out = [s.job_id for s in claimed]
    assert len(handed_out) == len(set(handed_out))
    cancelled = {j for j, r in results.items() if r == "cancelled"}
    assert cancelled.isdisjoint(handed_out), "a job reported cancelled was claimed"
    assert set(results.values()) <= {"cancelled", "cancel_requested", "terminal"}
    assert cancelled | set(handed_out) == set(job_ids)
    assert counts(storage, conn, Q) == {k: v for k, v in {"cancelled": len(cancelled),
                                                          "completed": len(handed_out)}.items() if v}


def test_two_promoters_promote_each_due_job_once(pg_dsn, schema, storage, conn):
    cli = Client(None, schema)
    with connect(pg_dsn, schema, autocommit=False, tag="producer") as p:
        jobs = [cli.enqueue("k", {"i": i}, queue=Q, delay=3600, conn=p) for i in range(600)]
        p.commit()
    assert make_due(conn, schema) == 600
    promoted = [0, 0]

    def promoter(k: int) -> Callable[[], None]:
        def run() -> None:
            with connect(pg_dsn, schema, tag=f"promoter{k}") as c:
                st = Storage(schema)
                while (n := st.deferred_promote(c, 25)) > 0:
                    promoted[k] += n
        return run

    run_threads([promoter(0), promoter(1)])
    assert sum(promoted) == 600
    snaps = claim(storage, conn, Q, 1000)
    assert sorted(s.job_id for s in snaps) == sorted(jobs)
    assert counts(storage, conn, Q) == {"running": 600}


def test_rotation_and_prune_against_live_traffic_lose_nothing(pg_dsn, schema, storage, conn):
    total, producers = 6000, 3
    stop = threading.Event()
    outcomes: list[str] = []
    claimed: list[int] = []
    lock = threading.Lock()

    def producer(k: int) -> Callable[[], None]:
        def run() -> None:
            with connect(pg_dsn, schema, tag=f"producer{k}") as c:
                cli = Client(None, schema)
                for b in range(total // producers // 100):
                    cli.enqueue_many("k", [{"p": k, "b": b, "i": i} for i in range(100)], queue=Q, conn=c)
        return run

    def claimer(k: int) -> Callable[[], None]:
        def run() -> None:
            with connect(pg_dsn, schema, tag=f"claimer{k}") as c:
                st = Storage(schema)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    snaps = st.lane_claim(c, Q, 50)
                    if snaps:
                        with c.transaction():
                            assert st.receipt_complete(c, snaps, {(s.claim_slot, s.claim_id) for s in snaps}) == []
                        with lock:
                            claimed.extend(s.job_id for s in snaps)
                    with lock:
                        if len(claimed) >= total:
                            stop.set()
                            return
        return run

    def maintainer() -> None:
        with connect(pg_dsn, schema, tag="maintainer") as c:
            st = Storage(schema)
            while not stop.is_set():
                for ring in ("claim", "ready", "claim"):
                    st.ring_rotate(c, ring)
                    state = st.ring_state(c)[ring]
                    for s in range(int(state["slots"])):
                        if s != state["slot"]:
                            outcomes.append(st.ring_prune(c, ring, s, 20))

    run_threads([producer(0), producer(1), producer(2), claimer(0), claimer(1), maintainer], timeout=90)
    assert len(claimed) == len(set(claimed)) == total
    assert "pruned" in outcomes
    assert storage.queue_counts_exact(conn) == {Q: {"completed": total}}
    assert claim(storage, conn, Q, 100) == []
