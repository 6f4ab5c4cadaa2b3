"""A limited queue's claim while callbacks wait elsewhere: lane_claim_limited of 0010 against 0035's.

Two schemas on one server: ``<schema>_before`` is migrated fully, then gets ``lane_claim_limited``
as migration 0010 created it (its parked callbacks counted with ``count(*)`` over every lease);
``<schema>_after`` keeps 0035's (an index on ``leases (queue)``, counted up to the room). In each,
``--leases`` callbacks of another queue are parked (claimed, then ``attempt_register_callback``)
and the limited queue (``max_running`` 100) holds a backlog. Blocks of ``--per-block`` one-job
claims alternate between the schemas (AB BA ...); each claim runs in a transaction that is rolled
back, so every block sees the same rows. Measured per claim: the backend's CPU (``/proc``, so the
server must be local) and the round trip.

    .venv/bin/python perf/limited_leases_ab.py --dsn DSN [--schema bench_limited_leases]
        [--leases 20000] [--rounds 8] [--per-block 300]
"""

from __future__ import annotations

import argparse
import os
import time

import psycopg
from claim_order_ab import alternated, print_rounds  # perf/ is on the path when this runs as a script
from claim_segment_ab import backend_cpu

from awa_fast.client import Client
from awa_fast.storage import Storage, connect, use_raw_jsonb
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import migrations

LIMITED, PARKED = "limited", "parked"


def body_of_0010() -> str:
    """lane_claim_limited as migration 0010 created it, as a CREATE OR REPLACE with 0010's settings."""
    text = next(m.text for m in migrations() if m.version == 10)
    start = text.index("CREATE FUNCTION __SCHEMA__.lane_claim_limited(")
    end = text.index("END $$;", start) + len("END $$;")
    return (text[start:end].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
            .replace("LANGUAGE plpgsql AS $$", "LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan "
                     "SET jit = off AS $$", 1))


def prepare(dsn: str, schema: str, leases: int) -> psycopg.Connection:
    """Parked callbacks of another queue and a limited backlog in ``schema``; the claimer's connection."""
    storage = Storage(schema)
    client = Client(dsn, schema)
    client.enqueue_many("bench.noop", ({"i": i} for i in range(leases)), queue=PARKED)
    client.enqueue_many("bench.noop", ({"i": i} for i in range(2_000)), queue=LIMITED)
    client.close()
    conn = connect(dsn, application_name="perf:limited_leases")
    use_raw_jsonb(conn)
    with conn.transaction():
        parked = 0
        while parked < leases:
            snaps, _ = storage.lane_claim_result(conn, PARKED, min(1024, leases - parked))
            for snap in snaps:
                if storage.attempt_register_callback(conn, snap, 3600.0) is None:
                    raise SystemExit("a callback could not be parked")
            parked += len(snaps)
    conn.execute(f"ANALYZE {schema}.leases")
    storage.queue_limits_set(conn, LIMITED, max_running=100)
    return conn


def block(conn: psycopg.Connection, claim: str, claims: int) -> tuple[float, float]:
    """(backend CPU us, round trip us) per one-job limited claim, each rolled back."""
    pid = conn.info.backend_pid
    cpu = wall = 0.0
    for _ in range(claims):
        conn.execute("BEGIN")
        c0, t0 = backend_cpu(pid), time.perf_counter()
        rows = conn.execute(claim, (LIMITED, 1, 0, 1), prepare=True).fetchall()
        wall += time.perf_counter() - t0
        cpu += backend_cpu(pid) - c0
        conn.execute("ROLLBACK")
        if sum(1 for r in rows if r[0] is not None) != 1:
            raise SystemExit("a limited claim did not take its one job")
    return cpu / claims * 1e6, wall / claims * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--schema", default="bench_limited_leases")
    ap.add_argument("--leases", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-block", type=int, default=300)
    args = ap.parse_args()
    if not args.schema.startswith("bench"):
        raise SystemExit("--schema must start with 'bench' (it is dropped)")
    conns, claims = {}, {}
    for name in ("before", "after"):
        schema = f"{args.schema}_{name}"
        with psycopg.connect(args.dsn, autocommit=True) as c:
            c.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        migrate(args.dsn, schema)
        if name == "before":
            with psycopg.connect(args.dsn, autocommit=True) as c:
                c.execute(body_of_0010().replace("__SCHEMA__", schema))
        conns[name] = prepare(args.dsn, schema, args.leases)
        claims[name] = Storage(schema).q["lane_claim_limited"]
    for name in conns:
        block(conns[name], claims[name], 20)  # plans made
    load = os.getloadavg()[0]
    res = alternated(lambda name: block(conns[name], claims[name], args.per_block), args.rounds)
    print(f"{args.leases} callbacks parked on another queue; one-job limited claims, {args.rounds} rounds x "
          f"{args.per_block} per arm; load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print_rounds(res)
    for c in conns.values():
        c.close()
    for name in ("before", "after"):
        with psycopg.connect(args.dsn, autocommit=True) as c:
            c.execute(f"DROP SCHEMA {args.schema}_{name} CASCADE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
