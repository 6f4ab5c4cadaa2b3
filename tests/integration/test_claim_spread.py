"""Two ways a deep backlog keeps every stripe busy.

- A bulk enqueue of several chunks spreads them over the queue's enqueue
  shards, one lane each, so stripes claim side by side instead of taking
  turns on one lane head (``Client.enqueue_many``, ``lane_reserve``).
- An adaptive claimer asks for its next claim while a whole claim's jobs
  still wait locally (``runtime.claimer.claim_ahead``).
"""

from __future__ import annotations

import asyncio
import threading
import time

from awa_fast.client import Client
from awa_fast.jobs import JobSpec
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.storage import Storage
from awa_fast.storage.copy_rows import COPY_LANES
from tests.fixtures.waiting import wait_for
from tests.integration.storage_helpers import claim


def test_the_chunks_of_one_bulk_enqueue_go_to_different_lanes(pg_dsn, schema, storage, conn):
    cli = Client(pg_dsn, schema)
    try:
        ids = cli.enqueue_many("k", [{"i": i} for i in range(30)], queue="spread", chunk=10, return_ids=True)
        lanes = [i >> 40 for i in ids]
        assert len(set(lanes)) == 3  # one lane per chunk
        assert [lanes[c * 10] for c in range(3)] == [lanes[c * 10 + 9] for c in range(3)]  # a chunk stays whole
        # at most COPY_LANES lanes per call: chunk 4 goes back to chunk 0's lane, after its rows
        six = cli.enqueue_many("k", [{"i": i} for i in range(60)], queue="six", chunk=10, return_ids=True)
        lanes6 = [six[c * 10] >> 40 for c in range(6)]
        assert len(set(lanes6)) == COPY_LANES == 4 and lanes6[4] == lanes6[0] and lanes6[5] == lanes6[1]
        assert six[40] > six[9] and (six[40] & (2**40 - 1)) == (six[9] & (2**40 - 1)) + 1
        # a queue with one shard has one lane for all of them
        storage.queue_configure(conn, "narrow", enqueue_shards=1)
        one = cli.enqueue_many("k", [{"i": i} for i in range(30)], queue="narrow", chunk=10, return_ids=True)
        assert len({i >> 40 for i in one}) == 1
    finally:
        cli.close()
    assert len(claim(storage, conn, "spread", 100)) == 30


def test_async_bulk_enqueue_spreads_its_chunks_too(pg_dsn, schema):
    async def go() -> list[int]:
        import psycopg

        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
            cli = Client(None, schema)
            return await cli.enqueue_many_async("k", [{"i": i} for i in range(20)], queue="aspread", conn=aconn,
                                                chunk=5, return_ids=True)

    ids = asyncio.run(go())
    assert len({i >> 40 for i in ids}) == 4


def _spied_claimer(pg_dsn: str, schema: str, queue: str, handler, concurrency: int, jobs: int,  # noqa: ANN001
                   on_claim) -> tuple[Claimer, threading.Thread]:  # noqa: ANN001
    """An adaptive claimer of ``queue`` whose every plain claim calls ``on_claim(claimer, limit)`` first.

    ``jobs`` jobs of kind ``<queue>.work`` are enqueued before it starts; the thread is running.
    """
    cfg = ClaimerConfig(pg_dsn, schema, queue, concurrency=concurrency, claim_batch=1024, adaptive_batch=True,
                        poll_interval=0.2)
    kind = f"{queue}.work"
    claimer = Claimer(cfg, {kind: JobSpec(kind, handler, queue, 2, 3, False, None)})
    base = Storage(schema)

    class Spy(Storage):
        __slots__ = ()

        def lane_claim_result(self, c, q, limit, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN201
            on_claim(claimer, limit)
            return base.lane_claim_result(c, q, limit, *a, **k)

    claimer.storage = Spy(schema)
    claimer.limits.storage = claimer.storage
    client = Client(pg_dsn, schema)
    client.enqueue_many(kind, [{"i": i} for i in range(jobs)], queue=queue)
    client.close()
    t = threading.Thread(target=claimer.run, daemon=True)
    t.start()
    return claimer, t


def test_an_adaptive_claimer_claims_again_while_a_whole_claim_still_waits(pg_dsn, schema):
    gate = threading.Event()
    finished: list[int] = []

    def handler(job):  # noqa: ANN001, ANN202
        gate.wait(60)
        finished.append(job.id)

    calls: list[tuple[int, int]] = []  # (jobs asked for, jobs held by the claimer when it asked)
    claimer, t = _spied_claimer(pg_dsn, schema, "ahead", handler, 4, 500,
                                lambda cl, limit: calls.append((limit, cl.outstanding)))
    try:
        # Every handler is blocked: the claimer holds its first claim's 16 jobs, 4 of them running,
        # and still claims once more. With one claim buffered it would wait for the workers.
        wait_for(lambda: len(calls) >= 2, 20, "a second claim while the first one's jobs wait")
        assert calls[0] == (16, 0)
        assert calls[1][1] == 16 > claimer.config.concurrency
        wait_for(lambda: claimer.outstanding == 16 + calls[1][0], 10, "the second claim's jobs held")
        gate.set()
        wait_for(lambda: len(finished) == 500, 60, "all 500 jobs run")
    finally:
        gate.set()
        claimer.stop()
        t.join(30)
    assert sorted(finished) == sorted(set(finished))  # each once


def test_claim_ahead_holds_at_most_two_local_work_spans_of_measured_handlers(pg_dsn, schema):
    """``claim_ahead``'s promise: two claims hold at most ~2 x LOCAL_WORK_S of handler work.

    The claim size of slow-ish handlers is clamped up to the floor (16 here), not down to
    LOCAL_WORK_S, so buffering two floor-sized claims holds more than that: with 20 ms
    handlers and concurrency 2, 32 buffered jobs are 0.32 s of work (one claim: 0.16 s).
    Jobs held here count against ``max_running`` and the queue's deadline (counted from
    the claim) and are not available to other claimers.
    """
    from awa_fast.runtime.claimer import LOCAL_WORK_S

    done: list[int] = []

    def handler(job):  # noqa: ANN001, ANN202
        time.sleep(0.02)
        done.append(job.id)

    held_work: list[float] = []  # seconds of measured handler work buffered after each steady-state claim

    def on_claim(cl: Claimer, limit: int) -> None:
        avg, conc = cl.executor.avg_handler_s, cl.config.concurrency
        if avg is not None and len(done) >= 80:
            held_work.append((cl.outstanding + limit - conc) * avg / conc)

    claimer, t = _spied_claimer(pg_dsn, schema, "slowish", handler, 2, 260, on_claim)
    try:
        wait_for(lambda: len(done) == 260, 60, "all 260 jobs run")
    finally:
        claimer.stop()
        t.join(30)
    assert held_work, "no claim after the warm-up"
    assert max(held_work) <= 2 * LOCAL_WORK_S * 1.25, held_work
