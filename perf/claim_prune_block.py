"""How long one claim-ring prune stops the claim ring's readers, by the number of receipts in the slot.

A claim reads every child of the claim ring (its cursor advance probes them all), so it waits
while a prune holds ACCESS EXCLUSIVE on a sealed slot's children: from its ``LOCK TABLE`` through
the gates it reads again under the lock, the ``TRUNCATE`` and the commit. Per size, this script
fills one claim slot with that many one-job receipts (claimed and completed one by one, as a
quiet queue's are), rotates the ring, moves the lane's cursor past them, and prunes the sealed
slot while a reader on another connection runs the claim's cursor-advance read of the ring
(``max(last_seq)`` of a lane over every child) back to back. The reader's longest statement is
the time the prune held the ring; its median is the statement without a prune.

The schema is dropped and migrated anew by the ``awa_fast`` this interpreter imports, so an
A/B of two commits runs each tree in turn::

    PYTHONPATH=<tree> python -P perf/claim_prune_block.py --dsn DSN [--schema bench_prune_block]
        [--receipts 200,4000,16000] [--rounds 1]
"""

from __future__ import annotations

import argparse
import threading
import time

import psycopg

from awa_fast import App
from awa_fast.storage import CLOSE_COMPLETE, Storage, connect

QUEUE = "q"


def fill_slot(app: App, storage: Storage, conn: psycopg.Connection, n: int) -> int:
    """``n`` one-job receipts, each claimed and completed, in the current claim slot; the slot."""
    app.enqueue_many("noop", [{"i": i} for i in range(n)], queue=QUEUE)
    for _ in range(n):
        [snap] = storage.lane_claim(conn, QUEUE, 1)
        storage.attempt_close(conn, [(snap, CLOSE_COMPLETE, None, None)])
    return int(storage.ring_state(conn)["claim"]["slot"])


def prune_while_reading(dsn: str, schema: str, storage: Storage, conn: psycopg.Connection,
                        slot: int) -> dict[str, float | str]:
    """Prune ``slot`` while a reader reads the claim ring back to back; the reader's longest and median statement."""
    stop = threading.Event()
    took: list[float] = []
    started = threading.Event()

    def reader() -> None:
        with connect(dsn) as r:
            while not stop.is_set():
                t = time.perf_counter()
                r.execute(f'SELECT max(last_seq) FROM "{schema}".lease_claims WHERE lane_id = 1 AND last_seq > 0')
                took.append((time.perf_counter() - t) * 1e3)
                started.set()

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait(10)
    time.sleep(0.2)  # a baseline of reads without a prune
    t0 = time.perf_counter()
    word = storage.ring_prune(conn, "claim", slot, 2000)
    prune_ms = (time.perf_counter() - t0) * 1e3
    time.sleep(0.2)
    stop.set()
    thread.join()
    took.sort()
    return {"word": word, "prune_ms": prune_ms, "reader_max_ms": took[-1], "reader_p50_ms": took[len(took) // 2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", required=True)
    p.add_argument("--schema", default="bench_prune_block")
    p.add_argument("--receipts", default="200,4000,16000", help="slot sizes, comma-separated")
    p.add_argument("--rounds", type=int, default=1)
    a = p.parse_args()
    if not a.schema.startswith("bench"):
        raise SystemExit("--schema must start with 'bench' (it is dropped and migrated anew)")
    sizes = [int(x) for x in a.receipts.split(",")]
    for r in range(a.rounds):
        with connect(a.dsn) as c:  # autocommit, as connect() opens it
            c.execute(f'DROP SCHEMA IF EXISTS "{a.schema}" CASCADE')
        app = App(a.dsn, a.schema)
        app.migrate()
        storage = Storage(a.schema)
        with connect(a.dsn) as conn:
            for n in sizes:
                slot = fill_slot(app, storage, conn, n)
                assert storage.ring_rotate(conn, "claim") is not None, "the next claim slot is not free"
                # one job through the new slot, then an empty claim: the lane's cursor passes every
                # receipt of the sealed slot (and the new one), so its gates can pass
                fill_slot(app, storage, conn, 1)
                storage.lane_claim(conn, QUEUE, 1)
                out = prune_while_reading(a.dsn, a.schema, storage, conn, slot)
                print(f"round {r} receipts {n:6d}: {out['word']:8s} prune {out['prune_ms']:7.2f} ms, "
                      f"reader longest {out['reader_max_ms']:6.2f} ms (median {out['reader_p50_ms']:.3f})", flush=True)
        app.close()


if __name__ == "__main__":
    main()
