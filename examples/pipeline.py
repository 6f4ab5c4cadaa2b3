"""A batch pipeline: bulk-enqueue rows by COPY, drain them in this process, print the summary.

    python examples/pipeline.py --dsn postgresql://app@db/app             # 1,000,000 rows
    python examples/pipeline.py --count 10000 --json                      # small, machine-readable

``app.enqueue_many`` writes the rows by binary COPY in one transaction;
``app.run_worker(until_empty=True)`` works them with the same claimers as
``awa-fast supervise`` and returns once no job of the queue is available or
running, with what it wrote (completed, retried, failed, cancelled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from awa_fast.app import App
from awa_fast.errors import TerminalError


def build_app(dsn: str | None, schema: str) -> App:
    app = App(dsn, schema)

    @app.job("pipeline.score", queue="pipeline")
    def score(job) -> None:  # noqa: ANN001
        row = job.args
        if not isinstance(row.get("value"), int):
            raise TerminalError(f"row {row.get('id')} has no integer value")  # to the DLQ, no retries
        # (the real work: score the row, write it somewhere)

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", default=os.environ.get("AWA_FAST_DSN") or os.environ.get("DATABASE_URL"),
                   help="PostgreSQL DSN (default: AWA_FAST_DSN, DATABASE_URL, else the embedded server)")
    p.add_argument("--schema", default=os.environ.get("AWA_FAST_SCHEMA", "awa_fast"))
    p.add_argument("--count", type=int, default=1_000_000, help="rows to enqueue (default 1,000,000)")
    p.add_argument("--stripes", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = p.parse_args(argv)

    app = build_app(args.dsn, args.schema)
    app.migrate()
    t0 = time.perf_counter()
    enqueued = app.enqueue_many("pipeline.score", ({"id": i, "value": i % 997} for i in range(args.count)))
    t1 = time.perf_counter()
    summary = app.run_worker({"pipeline": {"stripes": args.stripes, "concurrency": args.concurrency,
                                           "batch": 1024}}, until_empty=True)
    t2 = time.perf_counter()
    app.close()
    out = {"enqueued": enqueued, "enqueue_s": round(t1 - t0, 3), "drain_s": round(t2 - t1, 3),
           "jobs_per_s": round(summary.completed / max(t2 - t1, 1e-9)), **dataclasses.asdict(summary)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"enqueued {enqueued} rows in {out['enqueue_s']}s; drained in {out['drain_s']}s "
              f"({out['jobs_per_s']} jobs/s): completed {summary.completed}, retried {summary.retried}, "
              f"failed {summary.failed}, cancelled {summary.cancelled}")
    return 0 if summary.empty and summary.clean else 1


if __name__ == "__main__":
    sys.exit(main())
