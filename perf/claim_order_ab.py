"""A claim body against the one this checkout migrates to, on a queue fed through several lanes.

Two schemas on one server: ``<schema>_before`` is migrated fully, then gets the claim function as
it stood after migration ``--before`` (default: the last migration before the newest one that
restates it); ``<schema>_after`` is migrated fully. The function is ``claim_batch_v4`` (the plain
claim; by default its body of 0032, before 0034), or with ``--limited`` ``claim_batch_v3``, which
``lane_claim_limited`` calls for a queue with limits (the queue gets a rate limit far above what
the run reaches; by default its body of 0025).

In each schema, ``--lanes`` producer connections on distinct enqueue shards take turns (one job
each, ``job_enqueue_v3``, committed), so the lanes a claim took from stay candidates behind their
receipts, as in a queue fed by several producer connections; a claimer then claims ``--batch``
jobs. Blocks of ``--per-block`` claims alternate between the schemas (AB BA ...);
only the claim call is measured: its backend's CPU (``/proc/<pid>/stat``, so the server must be
local) and its round trip, per claim.

    .venv/bin/python perf/claim_order_ab.py --dsn DSN [--schema bench_claim_order] [--lanes 6]
        [--batch 1] [--rounds 8] [--per-block 600] [--limited] [--before VERSION]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import psycopg
from claim_lanes_ab import shard_conns  # perf/ is on the path when this runs as a script
from claim_segment_ab import backend_cpu

from awa_fast.limits import Rate
from awa_fast.storage import Storage, connect, use_raw_jsonb
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import migrations

QUEUE = "claim_order"


def restating(function: str) -> list[int]:
    """The versions of the migrations that restate ``function`` (CREATE OR REPLACE), in order."""
    head = f"CREATE OR REPLACE FUNCTION __SCHEMA__.{function}("
    return [m.version for m in migrations() if head in m.text]


def body_as_of(function: str, version: int) -> str:
    """``function``'s CREATE OR REPLACE statement as the last migration up to ``version`` states it."""
    head = f"CREATE OR REPLACE FUNCTION __SCHEMA__.{function}("
    stated = [v for v in restating(function) if v <= version]
    if not stated:
        raise SystemExit(f"no migration up to {version} restates {function}")
    text = migrations()[stated[-1] - 1].text
    start = text.index(head)
    end = text.index("END $function$;", start) + len("END $function$;")
    return text[start:end]


def alternated(block: Callable[[str], tuple[float, float]], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """``block(arm)`` for the arms "before" and "after", ``rounds`` times, the order flipping every
    round (AB BA ...) so a drift of the load hits both alike; each arm's (CPU us, round trip us) per block."""
    res: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for r in range(rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            res[name].append(block(name))
    return res


def print_rounds(res: dict[str, list[tuple[float, float]]]) -> None:
    """Each arm's median backend CPU and round trip per claim, its blocks, and the rounds "after" won."""
    for name, rows in res.items():
        cpu = [x[0] for x in rows]
        print(f"{name:6s} backend CPU us/claim median {statistics.median(cpu):7.0f}  blocks {[round(x) for x in cpu]}"
              f"  round trip median {statistics.median(x[1] for x in rows):7.0f} us")
    lower = sum(1 for b, a in zip(res["before"], res["after"]) if a[0] < b[0])
    print(f"after lower in {lower} of {len(res['after'])} rounds")


class Arm:
    """One schema: its producers (one per lane), its claimer and the statements they run."""

    def __init__(self, dsn: str, schema: str, lanes: int, limited: bool) -> None:
        self.schema = schema
        self.claimer = connect(dsn, application_name="perf:claim_order:claimer")
        use_raw_jsonb(self.claimer)
        storage = Storage(schema)
        self.claimer.execute(f"SELECT {schema}.queue_ensure(%s)", (QUEUE,))
        if limited:
            storage.queue_limits_set(self.claimer, QUEUE, max_rate=Rate(1e6))
        self.producers = shard_conns(dsn, schema, QUEUE, lanes)
        self.enqueue = f"SELECT {schema}.job_enqueue_v3(%s, 2, 'bench.noop', '{{}}'::jsonb, NULL, 25, NULL)"
        self.claim = storage.q["lane_claim_limited" if limited else "lane_claim"]
        self.turn = 0

    def block(self, claims: int, batch: int) -> tuple[float, float]:
        """(backend CPU us, round trip us) per claim over ``claims`` claims of ``batch`` jobs."""
        pid = self.claimer.info.backend_pid
        cpu = wall = 0.0
        for _ in range(claims):
            for _ in range(batch):
                self.producers[self.turn % len(self.producers)].execute(self.enqueue, (QUEUE,))
                self.turn += 1
            c0, t0 = backend_cpu(pid), time.perf_counter()
            rows = self.claimer.execute(self.claim, (QUEUE, batch, 0, 1), prepare=True).fetchall()
            wall += time.perf_counter() - t0
            cpu += backend_cpu(pid) - c0
            took = sum(1 for r in rows if r[0] is not None)  # the backlog marker is no job
            if took != batch:
                raise SystemExit(f"{self.schema}: a claim took {took} jobs, not {batch}")
        return cpu / claims * 1e6, wall / claims * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--schema", default="bench_claim_order")
    ap.add_argument("--lanes", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-block", type=int, default=600)
    ap.add_argument("--limited", action="store_true", help="claim_batch_v3, through lane_claim_limited")
    ap.add_argument("--before", type=int, metavar="VERSION",
                    help="the before schema gets the function as it stood after this migration")
    args = ap.parse_args()
    function = "claim_batch_v3" if args.limited else "claim_batch_v4"
    before = args.before if args.before is not None else restating(function)[-2]
    if not 1 <= args.lanes <= 8:
        raise SystemExit("--lanes: 1 to 8 (a queue's default enqueue shards; one lane per shard)")
    if not args.schema.startswith("bench"):
        raise SystemExit("--schema must start with 'bench' (it is dropped)")
    arms = {}
    for name in ("before", "after"):
        schema = f"{args.schema}_{name}"
        with psycopg.connect(args.dsn, autocommit=True) as c:
            c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        migrate(args.dsn, schema)
        if name == "before":
            with psycopg.connect(args.dsn, autocommit=True) as c:
                c.execute(body_as_of(function, before).replace("__SCHEMA__", schema))
        arms[name] = Arm(args.dsn, schema, args.lanes, args.limited)
    for arm in arms.values():
        arm.block(50, args.batch)  # plans made, lanes created
    load = os.getloadavg()[0]
    res = alternated(lambda name: arms[name].block(args.per_block, args.batch), args.rounds)
    print(f"{args.lanes} lanes, claims of {args.batch}, {args.rounds} rounds x {args.per_block} claims per arm; "
          f"load {load:.2f} -> {os.getloadavg()[0]:.2f}; {function}, before = its body of migration {before}")
    print_rounds(res)
    for arm in arms.values():
        for c in (arm.claimer, *arm.producers):
            c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
