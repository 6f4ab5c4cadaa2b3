"""A job found by id: ready_rows_of before migration 0030 against its 0030 body, alternated on one server.

Two schemas on one private server (durable settings off: this measures reads), each with 16
ready slots of which ``--slots`` hold ``--rows`` lane-born jobs each (bulk COPY, the ring
rotated between loads), ANALYZEd. Schema ``before`` gets the body of migration 0019 back;
``after`` keeps the current one. One connection per schema prepares, as generic plans (the
plans a pooled connection keeps):

* ``ready_rows_of``: ``SELECT * FROM ready_rows_of($1)``;
* ``job_load``: ``SELECT job_load_keyed_v2($1)``, what App.get_job and ``awa-fast job show`` call.

Each round runs both statements over the same ``--ids`` random ids per schema, schemas
alternated (ABBA...), and reports the median time per call over ``--rounds`` rounds, then the
buffers of one ``EXPLAIN (ANALYZE, BUFFERS)`` per schema.

    .venv/bin/python perf/ready_rows_ab.py [--server system|embedded] [--rows 50000] [--slots 4]
        [--ids 400] [--rounds 10]

``--server system`` is the machine's PostgreSQL (15 here: no skip scan), ``embedded`` the
wheel's PostgreSQL 18.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import psycopg

from awa_fast.client import Client
from awa_fast.embedded import embedded_bindir, private_server, system_bindir
from awa_fast.storage import Storage
from awa_fast.storage.migrate import RingSizes, migrate
from awa_fast.storage.schema import migrations, render

STATEMENTS = {"ready_rows_of": "SELECT * FROM {s}.ready_rows_of($1)", "job_load": "SELECT {s}.job_load_keyed_v2($1)"}


def body_before_0030() -> str:
    """``CREATE OR REPLACE`` of ready_rows_of as migration 0019 wrote it."""
    text = next(m.text for m in migrations() if m.version == 19)
    start = text.index("CREATE FUNCTION __SCHEMA__.ready_rows_of")
    end = text.index("$function$;", start) + len("$function$;")
    return "CREATE OR REPLACE " + text[start + len("CREATE "):end]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", choices=("system", "embedded"), default="system")
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ids", type=int, default=400)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
    bindir = system_bindir() if a.server == "system" else embedded_bindir()
    if bindir is None:
        raise SystemExit("no system PostgreSQL here: use --server embedded")
    with private_server(bindir=bindir, settings={"fsync": "off", "shared_buffers": "512MB"}) as cluster:
        ids: dict[str, list[int]] = {}
        with psycopg.connect(cluster.dsn, autocommit=True) as c:
            print("server", c.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
            for s in ("before", "after"):
                migrate(cluster.dsn, s, RingSizes(ready=16, claim=8, lease=4))
                if s == "before":
                    c.execute(render(body_before_0030(), s))  # type: ignore[arg-type]
                ids[s] = []
                for _ in range(a.slots):
                    got = Client(None, s).enqueue_many("k", ({"i": i} for i in range(a.rows)), queue="q", conn=c,
                                                       return_ids=True)
                    ids[s] += got  # type: ignore[arg-type]
                    Storage(s).ring_rotate(c, "ready")
                c.execute(f"ANALYZE {s}.ready_entries")
        rng = random.Random(1)
        picks = {s: [rng.choice(v) for _ in range(a.ids)] for s, v in ids.items()}
        conns = {}
        for s in ("before", "after"):
            conn = psycopg.connect(cluster.dsn, autocommit=True)
            conn.execute("SET plan_cache_mode = force_generic_plan")
            for name, text in STATEMENTS.items():
                conn.execute(f"PREPARE {name}(bigint) AS " + text.format(s=s))  # type: ignore[arg-type]
            conns[s] = conn
        times: dict[tuple[str, str], list[float]] = {(s, n): [] for s in conns for n in STATEMENTS}
        for r in range(a.rounds):
            for s in (("before", "after") if r % 2 == 0 else ("after", "before")):
                for name in STATEMENTS:
                    t = time.perf_counter()
                    for job_id in picks[s]:
                        conns[s].execute(f"EXECUTE {name}({job_id})").fetchall()  # type: ignore[arg-type]
                    times[(s, name)].append((time.perf_counter() - t) / len(picks[s]) * 1e6)
        for (s, name), values in times.items():
            print(f"{s:7} {name:14} median {statistics.median(values):8.1f} us per call  rounds "
                  + " ".join(f"{v:.0f}" for v in values))
        for s, conn in conns.items():
            plan = [row[0] for row in conn.execute(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE ready_rows_of({picks[s][0]})")]  # type: ignore[arg-type]
            print(f"{s:7} ready_rows_of: {plan[1].strip() if len(plan) > 1 else ''}; {plan[-1]}")
            conn.close()


if __name__ == "__main__":
    main()
