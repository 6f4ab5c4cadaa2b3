"""A one-job claim's backend CPU: claim_batch_v4 as migration 0032 made it against its body before 0032.

Two schemas on one private embedded PostgreSQL 18 (durable settings; the claim connection at
``synchronous_commit = off``, since this measures the claim's CPU, not the WAL flush). Schema
``before`` gets the body of claim_batch_v4 without 0032's lookup in the current ready slot first;
``after`` keeps the current one. Each round, per schema: ``--claims`` times, enqueue one job
(``Client.enqueue``, another connection) and claim it (the named query ``lane_claim``, limit 64,
binary results), as an idle queue at a trickle does (the pickup path); the claim backend's CPU
(``/proc/<pid>/stat``, utime + stime) per claim. Schemas alternate (ABBA...); the first round
warms both and is not counted. ``--rotate`` rotates the ready ring before the run so the claims
come from slot 1 with older rows claimed in slot 0. ``--older-backlog`` instead loads every job
the run claims by one bulk COPY, then rotates: each claim takes one job of a backlog that is not in
the current slot (the lookup there misses, then reads the ring), claimed one job per call (limit 1), and nothing is
enqueued per claim.

    .venv/bin/python perf/claim_segment_ab.py [--rounds 16] [--claims 500] [--rotate | --older-backlog]
"""

from __future__ import annotations

import argparse
import os
import statistics

import psycopg

from awa_fast.client import Client
from awa_fast.embedded import embedded_bindir, private_server
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.migrate import RingSizes, migrate
from awa_fast.storage.schema import migrations, render

NEW_LOOKUP_START = "            v_hit := false;\n"
NEW_LOOKUP_END = "                EXIT WHEN NOT FOUND;\n            END IF;\n"
OLD_LOOKUP = """            SELECT g.ready_slot, greatest(g.first_seq, v_cur + 1), g.last_seq
            INTO v_slot, v_first, v_seg_last FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = v_lid AND g.last_seq > v_cur
            ORDER BY g.last_seq LIMIT 1;
            EXIT WHEN NOT FOUND;
"""


def body_before_0032() -> str:
    """claim_batch_v4 of migration 0032 with its segment lookup as it was before."""
    text = next(m.text for m in migrations() if m.version == 32)
    fn = text[text.index("CREATE OR REPLACE FUNCTION __SCHEMA__.claim_batch_v4("):]
    start = fn.index(NEW_LOOKUP_START)
    end = fn.index(NEW_LOOKUP_END, start) + len(NEW_LOOKUP_END)
    return fn[:start] + OLD_LOOKUP + fn[end:]


def backend_cpu(pid: int) -> float:
    """User plus system CPU seconds of one local process (a backend), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--claims", type=int, default=500)
    p.add_argument("--rotate", action="store_true")
    p.add_argument("--older-backlog", action="store_true")
    a = p.parse_args()
    settings = {"fsync": "on", "synchronous_commit": "on", "shared_buffers": "256MB", "wal_level": "replica"}
    with private_server(bindir=embedded_bindir(), settings=settings) as cluster:
        arms = {}
        for s in ("before", "after"):
            migrate(cluster.dsn, s, RingSizes(ready=16, claim=8, lease=4))
            claimer = psycopg.connect(cluster.dsn, autocommit=True)
            producer = psycopg.connect(cluster.dsn, autocommit=True)
            if s == "before":
                claimer.execute(render(body_before_0032(), s))  # type: ignore[arg-type]
            storage = Storage(s)
            if a.rotate:
                Client(None, s).enqueue("k", {}, queue="q", conn=producer)
                claimer.execute(storage.q["lane_claim"], ("q", 64, 0, 1)).fetchall()  # type: ignore[arg-type]
                storage.ring_rotate(claimer, "ready")
            if a.older_backlog:
                Client(None, s).enqueue_many("k", ({"i": i} for i in range((a.rounds + 1) * a.claims)), queue="q",
                                             conn=producer)
                storage.ring_rotate(claimer, "ready")
            use_raw_jsonb(claimer)
            storage.session_utc(claimer)
            storage.session_read_committed(claimer)
            claimer.execute("SET synchronous_commit = off")
            pid = int(claimer.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
            arms[s] = (claimer, producer, storage, Client(None, s), pid)
        limit = 1 if a.older_backlog else 64  # a backlog: one job per claim, as a claim at concurrency 1 takes
        per_claim: dict[str, list[float]] = {s: [] for s in arms}
        for r in range(a.rounds + 1):
            for s in (("before", "after") if r % 2 == 0 else ("after", "before")):
                claimer, producer, storage, client, pid = arms[s]
                start = backend_cpu(pid)
                for i in range(a.claims):
                    if not a.older_backlog:
                        client.enqueue("k", {"i": i}, queue="q", conn=producer)
                    rows = claimer.execute(storage.q["lane_claim"], ("q", limit, 0, 1), binary=True).fetchall()  # type: ignore[arg-type]
                    assert rows and rows[0][0] is not None
                if r:
                    per_claim[s].append((backend_cpu(pid) - start) / a.claims * 1e6)
        for s, values in per_claim.items():
            print(f"{s:6} backend CPU per one-job claim: median {statistics.median(values):.0f} us  rounds "
                  + " ".join(f"{v:.0f}" for v in values))
        ratios = [b / x for x, b in zip(per_claim["before"], per_claim["after"])]
        below = sum(x < 1 for x in ratios)
        print(f"after / before per round: median {statistics.median(ratios):.3f}, below 1 in {below} of {len(ratios)}")
        for claimer, producer, *_ in arms.values():
            claimer.close()
            producer.close()


if __name__ == "__main__":
    main()
