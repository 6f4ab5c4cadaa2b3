"""Server time and locks of one claim call: the live claim function against variants of it.

Issue 16 step 4 (a claim that touches fewer ring partitions). One connection calls each
variant in interleaved blocks (the order flips every block, so load drifts hit all alike) on a
freshly migrated schema, and reads each block's server time per call from pg_stat_statements
(top-level statements only), plus the client round trip per call. Variants are built from the
text of ``claim_batch_v3`` as migration 0007 created it (``old``), in the bench schema only;
``v3`` is the live function (with the lane-run fix of this branch). Nothing here is a migration.

    python perf/claim_slots_ab.py --home /tmp/some-home [--scenario pickup|deep1|deep1024|idle]
        [--blocks 6] [--per-block 400] [--variants old,v3,slot_f,...] [--locks] [--nested]

Scenarios: ``pickup`` enqueues one job (job_enqueue_v2) and claims it (limit 64), both
committed, as an idle queue at a trickle does; ``deep1`` / ``deep1024`` claim 1 / 1024 jobs
of a 200k backlog in a transaction that is rolled back (the backlog stays put); ``idle``
claims from a queue whose lanes exist but hold nothing. ``--locks`` prints the locks one call
holds before its transaction ends; ``--nested`` the nested statements of ``v3``
(pg_stat_statements.track = all). The server under ``--home`` is started with
pg_stat_statements preloaded (a server already running there must have it).

Variants (the first named is the reference of the per-round ratios): ``old`` (0007's text),
``v3`` (live), ``slot`` / ``slot_f`` (the claim slot passed in, on the old / fixed body: no
ring_current call), ``dynseg`` (the segment lookup on the given ready slot's child by dynamic SQL
first), ``dynsql`` (the same with the slot from ring_current('ready'), plus the lane-run fix as a
window), ``dynlast`` (the receipt's last_seq read back from its own child by dynamic SQL),
``run`` / ``run2`` (the lane-run fix as a window over the rows: the first ways tried).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time
from collections.abc import Callable

import psycopg

from awa_fast.embedded.servers import ensure_embedded
from awa_fast.storage.migrate import migrate
from awa_fast.storage.schema import render

SCHEMA = "bench_claim_slots_ab"
QUEUE = "q"
SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all",
            "pg_stat_statements.max": "10000"}

SIG_OLD = "claim_batch_v3(p_queue text, p_max int, p_stripe int DEFAULT 0, p_stripes int DEFAULT 1)"


def fixed_v3() -> str:
    """claim_batch_v3 as this branch's lane-run migration replaces it, schema token in it."""
    from awa_fast.storage.schema import migrations

    text = next(m.text for m in migrations() if m.name == "claim_lane_runs")
    start = text.index("CREATE OR REPLACE FUNCTION __SCHEMA__.claim_batch_v3(")
    return text[start:text.index("END $$;", start) + len("END $$;")].replace("CREATE OR REPLACE FUNCTION",
                                                                            "CREATE FUNCTION")


def original_v3() -> str:
    """claim_batch_v3 as migration 0007 created it (before the lane-run fix), schema token in it."""
    from awa_fast.storage.schema import migrations

    text = next(m.text for m in migrations() if m.version == 7)
    start = text.index("CREATE FUNCTION __SCHEMA__.claim_batch_v3(")
    return text[start:text.index("END $$;", start) + len("END $$;")]


def _variant(body: str, name: str, edits: list[tuple[str, str]], extra_args: str = "") -> str:
    text = body.replace(SIG_OLD, f"{name}(p_queue text, p_max int, p_stripe int DEFAULT 0, "
                                 f"p_stripes int DEFAULT 1{extra_args})")
    for old, new in edits:
        if old not in text:
            raise SystemExit(f"variant {name}: text not found: {old[:80]!r}")
        text = text.replace(old, new)
    return text


RING_CURRENT = "        v_claim_slot := __SCHEMA__.ring_current('claim');"
SEG_LOOKUP = """            SELECT g.ready_slot INTO v_slot FROM __SCHEMA__.ready_segments g
            WHERE g.lane_id = v_lid AND g.last_seq > v_cur
            ORDER BY g.last_seq LIMIT 1;
            EXIT WHEN NOT FOUND;"""
LAST_LOOKUP = """            SELECT c.last_seq INTO v_last FROM __SCHEMA__.lease_claims c
            WHERE c.claim_slot = v_claim_slot AND c.claim_id = v_claim_id;
            EXIT WHEN NOT FOUND;"""
PICK_OLD = """                SELECT r.*, (t.lane_seq IS NOT NULL) AS tomb
                FROM"""
PICK_RUN = """                SELECT r.*, (t.lane_seq IS NOT NULL) AS tomb,
                       r.lane_seq - row_number() OVER (ORDER BY r.lane_seq) AS run
                FROM"""
RECEIPT_FROM = """                FROM picked p
                HAVING count(*) > 0"""
RECEIPT_FROM_RUN = """                FROM picked p
                WHERE p.run = (SELECT min(q.run) FROM picked q)
                HAVING count(*) > 0"""
OUT_WHERE = """            FROM picked p
            WHERE NOT p.tomb"""
OUT_WHERE_RUN = """            FROM picked p
            WHERE NOT p.tomb AND p.run = (SELECT min(q.run) FROM picked q)"""


def variants(body: str, only: tuple[str, ...] | None = None) -> dict[str, str]:
    """name -> CREATE FUNCTION text (schema token still in it); ``only``: of the fixed body, renamed ``*_f``."""
    if only is not None:  # the claim slot passed in, on the fixed body
        return {"slot_f": _variant(body, "claim_x_slot_f", [(RING_CURRENT,
                "        v_claim_slot := COALESCE(p_claim_slot, __SCHEMA__.ring_current('claim'));")],
                ", p_claim_slot integer DEFAULT NULL")}
    s = "__SCHEMA__"
    return {
        "old": _variant(body, "claim_x_old", []),
        # the claim slot passed in (what a fresh shared-memory publish gives): no ring_current call
        "slot": _variant(body, "claim_x_slot", [(RING_CURRENT,
                         f"        v_claim_slot := COALESCE(p_claim_slot, {s}.ring_current('claim'));")],
                         ", p_claim_slot integer DEFAULT NULL"),
        # the segment lookup on the hinted ready slot's own child first (dynamic SQL: one partition
        # locked, a plan per call), the fan-out over every partition only when it is not there
        "dynseg": _variant(body, "claim_x_dynseg", [(SEG_LOOKUP, f"""            v_slot := NULL;
            IF p_ready_slot IS NOT NULL THEN
                EXECUTE format('SELECT g.ready_slot FROM %s.ready_segments_%s g WHERE g.lane_id = $1 '
                               'AND g.last_seq > $2 AND g.first_seq <= $2 + 1 ORDER BY g.last_seq LIMIT 1',
                               '{s}', p_ready_slot) INTO v_slot USING v_lid, v_cur;
            END IF;
            IF v_slot IS NULL THEN
                SELECT g.ready_slot INTO v_slot FROM {s}.ready_segments g
                WHERE g.lane_id = v_lid AND g.last_seq > v_cur
                ORDER BY g.last_seq LIMIT 1;
                EXIT WHEN NOT FOUND;
            END IF;""")], ", p_ready_slot integer DEFAULT NULL"),
        # the lane-run fix with the run's first number from the segment lookup (no InitPlans)
        "run2": _variant(body, "claim_x_run2", [
            (PICK_OLD, PICK_RUN),
            (RECEIPT_FROM, RECEIPT_FROM.replace("HAVING", "WHERE p.run = v_first - 1\n                HAVING")),
            (OUT_WHERE, OUT_WHERE + " AND p.run = v_first - 1"),
            ("    v_skipped boolean := false;", "    v_skipped boolean := false;\n    v_first bigint;"),
            (SEG_LOOKUP, SEG_LOOKUP.replace(
                "SELECT g.ready_slot INTO v_slot",
                "SELECT g.ready_slot, greatest(g.first_seq, v_cur + 1) INTO v_slot, v_first"))]),
        # candidate: the lane-run fix, and the segment lookup first on the current ready slot's own
        # child (ring_current('ready') in SQL, no parameter), fanning out only when it is not there
        "dynsql": _variant(body, "claim_x_dynsql", [
            (PICK_OLD, PICK_RUN), (RECEIPT_FROM, RECEIPT_FROM_RUN), (OUT_WHERE, OUT_WHERE_RUN),
            (RING_CURRENT, RING_CURRENT + f"\n        v_hint := {s}.ring_current('ready');"),
            ("    v_skipped boolean := false;", "    v_skipped boolean := false;\n    v_hint int;"),
            (SEG_LOOKUP, f"""            v_slot := NULL;
            IF v_hint IS NOT NULL THEN
                EXECUTE format('SELECT g.ready_slot FROM %s.ready_segments_%s g WHERE g.lane_id = $1 '
                               'AND g.last_seq > $2 AND g.first_seq <= $2 + 1 ORDER BY g.last_seq LIMIT 1',
                               '{s}', v_hint) INTO v_slot USING v_lid, v_cur;
            END IF;
            IF v_slot IS NULL THEN
                SELECT g.ready_slot INTO v_slot FROM {s}.ready_segments g
                WHERE g.lane_id = v_lid AND g.last_seq > v_cur
                ORDER BY g.last_seq LIMIT 1;
                EXIT WHEN NOT FOUND;
            END IF;""")]),
        # the receipt's last_seq read back from its own claim partition (dynamic SQL)
        "dynlast": _variant(body, "claim_x_dynlast", [(LAST_LOOKUP, f"""            EXECUTE format(
                'SELECT c.last_seq FROM %s.lease_claims_%s c WHERE c.claim_slot = $1 '
                           'AND c.claim_id = $2', '{s}', v_claim_slot) INTO v_last USING v_claim_slot, v_claim_id;
            EXIT WHEN v_last IS NULL;""")]),
        # lane order across slots: take only the unbroken run of numbers the segment starts
        "run": _variant(body, "claim_x_run", [(PICK_OLD, PICK_RUN), (RECEIPT_FROM, RECEIPT_FROM_RUN),
                                              (OUT_WHERE, OUT_WHERE_RUN)]),
    }


CALLS = {
    "v3": "SELECT count(*) FROM __SCHEMA__.claim_batch_v3(%s::text, %s::int, 0, 1)",
    "old": "SELECT count(*) FROM __SCHEMA__.claim_x_old(%s::text, %s::int, 0, 1)",
    "slot": "SELECT count(*) FROM __SCHEMA__.claim_x_slot(%s::text, %s::int, 0, 1, 0)",
    "dynseg": "SELECT count(*) FROM __SCHEMA__.claim_x_dynseg(%s::text, %s::int, 0, 1, {ready})",
    "dynsql": "SELECT count(*) FROM __SCHEMA__.claim_x_dynsql(%s::text, %s::int, 0, 1)",
    "run2": "SELECT count(*) FROM __SCHEMA__.claim_x_run2(%s::text, %s::int, 0, 1)",
    "slot_f": "SELECT count(*) FROM __SCHEMA__.claim_x_slot_f(%s::text, %s::int, 0, 1, 0)",
    "dynlast": "SELECT count(*) FROM __SCHEMA__.claim_x_dynlast(%s::text, %s::int, 0, 1)",
    "run": "SELECT count(*) FROM __SCHEMA__.claim_x_run(%s::text, %s::int, 0, 1)",
}
FN = {"v3": "claim_batch_v3", "old": "claim_x_old", "slot": "claim_x_slot", "dynseg": "claim_x_dynseg",
      "dynlast": "claim_x_dynlast", "slot_f": "claim_x_slot_f", "run2": "claim_x_run2", "dynsql": "claim_x_dynsql",
      "run": "claim_x_run"}
ENQ = "SELECT __SCHEMA__.job_enqueue_v2(%s::text, 2, 'k', '{\"n\": 1}'::jsonb, NULL, 25, NULL)"


def setup(dsn: str, scenario: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        if not c.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchone():
            c.execute("CREATE EXTENSION pg_stat_statements")
    migrate(dsn, SCHEMA)
    with psycopg.connect(dsn, autocommit=True) as c:
        for text in variants(original_v3()).values():
            c.execute(render(text, SCHEMA))  # type: ignore[arg-type]
        for text in variants(fixed_v3(), only=("slot",)).values():
            c.execute(render(text, SCHEMA))  # type: ignore[arg-type]
        c.execute(render("SELECT __SCHEMA__.queue_ensure(%s)", SCHEMA), (QUEUE,))
        if scenario.startswith("deep"):
            from awa_fast.client import Client

            Client(dsn, SCHEMA).enqueue_many("k", ({"n": i} for i in range(200_000)), queue=QUEUE)
        elif scenario == "idle":
            c.execute(render("SELECT __SCHEMA__.lane_ensure(%s, 2, s) FROM generate_series(0, 7) s", SCHEMA),
                      (QUEUE,))
        c.execute("VACUUM ANALYZE")


def runner(dsn: str, scenario: str) -> tuple[Callable[[str], None], psycopg.Connection, psycopg.Connection]:
    claim = psycopg.connect(dsn, autocommit=scenario in ("pickup", "idle"))
    prod = psycopg.connect(dsn, autocommit=True)
    for c in (claim, prod):
        c.execute("SET synchronous_commit = off")  # server CPU, not the WAL flush
    ready = int(claim.execute(render("SELECT __SCHEMA__.ring_current('ready')", SCHEMA)).fetchone()[0])  # type: ignore[index]
    sql = {v: render(CALLS[v].replace("{ready}", str(ready)), SCHEMA) for v in CALLS}
    enq = render(ENQ, SCHEMA)
    limit = {"pickup": 64, "deep1": 1, "deep1024": 1024, "idle": 64}[scenario]

    def one(v: str) -> None:
        if scenario == "pickup":
            prod.execute(enq, (QUEUE,))
        claim.execute(sql[v], (QUEUE, limit))
        if scenario.startswith("deep"):
            claim.rollback()

    return one, claim, prod


CLOSE_OPEN = """INSERT INTO __SCHEMA__.lease_claim_closure_batches (claim_slot, claim_id, outcome)
SELECT c.claim_slot, c.claim_id, 1 FROM __SCHEMA__.lease_claims c
WHERE NOT EXISTS (SELECT 1 FROM __SCHEMA__.lease_claim_closure_batches b
                  WHERE b.claim_slot = c.claim_slot AND b.claim_id = c.claim_id)"""


def tidy(dsn: str) -> None:
    """What the runtime and the leader do between blocks: close the receipts, rotate and prune the claim ring."""
    from awa_fast.storage import Storage

    st = Storage(SCHEMA)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(render(CLOSE_OPEN, SCHEMA))
        st.ring_rotate(c, "claim")
        ring = st.ring_state(c)["claim"]
        cur = int(ring["slot"])
        for slot in range(int(ring["slots"])):
            if slot != cur:
                st.ring_prune(c, "claim", slot, 200)


def show_locks(dsn: str, scenario: str, names: list[str], prod: psycopg.Connection) -> None:
    with psycopg.connect(dsn) as c:
        ready = int(c.execute(render("SELECT __SCHEMA__.ring_current('ready')", SCHEMA)).fetchone()[0])  # type: ignore[index]
        c.rollback()
        for v in names:
            for _ in range(6):  # past the generic-plan switch
                if scenario == "pickup":
                    prod.execute(render(ENQ, SCHEMA), (QUEUE,))
                c.execute(render(CALLS[v].replace("{ready}", str(ready)), SCHEMA),
                          (QUEUE, 64 if scenario != "deep1024" else 1024))
                rows = c.execute("SELECT l.locktype, l.mode, l.fastpath, "
                                 "CASE WHEN l.relation IS NULL THEN NULL ELSE c.relkind::text END, count(*) "
                                 "FROM pg_locks l LEFT JOIN pg_class c ON c.oid = l.relation "
                                 "WHERE l.pid = pg_backend_pid() AND l.granted "
                                 "GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4").fetchall()
                c.rollback()
            rel = sum(int(r[4]) for r in rows if r[0] == "relation")
            print(f"locks held by one {v} call ({scenario}): {rel} relation locks")
            print("    (locktype, mode, fastpath, relkind, count):", rows)


def show_nested(dsn: str, one: Callable[[str], None], n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT pg_stat_statements_reset()")
        for _ in range(n):
            one("v3")
        rows = c.execute("SELECT toplevel, calls, round((total_exec_time * 1000 / calls)::numeric, 1), "
                         "round((total_plan_time * 1000 / greatest(calls, 1))::numeric, 1), "
                         "left(regexp_replace(query, '\\s+', ' ', 'g'), 110) FROM pg_stat_statements "
                         "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                         "AND calls >= %s ORDER BY toplevel DESC, total_exec_time DESC LIMIT 30", (n // 2,)).fetchall()
    print(f"nested statements of {n} v3 calls: toplevel, calls, exec us/call, plan us/call, query")
    for r in rows:
        print("   ", r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=pathlib.Path, required=True)
    ap.add_argument("--scenario", default="pickup", choices=("pickup", "deep1", "deep1024", "idle"))
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--per-block", type=int, default=400)
    ap.add_argument("--variants", default="old,v3,slot_f")
    ap.add_argument("--locks", action="store_true")
    ap.add_argument("--show-blocks", action="store_true")
    ap.add_argument("--pg-setting", action="append", default=[], metavar="KEY=VALUE",
                    help="restart the server under --home with this setting (e.g. max_locks_per_transaction=128)")
    ap.add_argument("--nested", action="store_true")
    a = ap.parse_args()
    names = a.variants.split(",")
    settings = dict(SETTINGS, **dict(kv.split("=", 1) for kv in a.pg_setting))
    if a.pg_setting or os.environ.get("AWA_FAST_AB_RESTART"):
        from awa_fast.embedded.servers import stop_embedded

        stop_embedded(a.home)
    dsn = ensure_embedded(a.home, settings=settings)
    setup(dsn, a.scenario)
    with psycopg.connect(dsn) as c:
        mlpt = c.execute("SHOW max_locks_per_transaction").fetchone()[0]  # type: ignore[index]
    print(f"scenario {a.scenario}, max_locks_per_transaction {mlpt}, load {os.getloadavg()}")
    one, claim, prod = runner(dsn, a.scenario)
    if a.locks:  # the producer of the run: its jobs stay in the run's one lane
        show_locks(dsn, a.scenario, names, prod)
    for v in names:  # plans cached before the first block
        for _ in range(50):
            one(v)
    if a.nested:
        show_nested(dsn, one, a.per_block)
    server: dict[str, list[float]] = {v: [] for v in names}
    lat: dict[str, list[float]] = {v: [] for v in names}
    with psycopg.connect(dsn, autocommit=True) as stats:
        for b in range(a.blocks):
            order = names if b % 2 == 0 else names[::-1]
            for v in order:
                if a.scenario == "pickup":
                    tidy(dsn)
                stats.execute("SELECT pg_stat_statements_reset()")
                for _ in range(a.per_block):
                    t0 = time.perf_counter()
                    one(v)
                    lat[v].append(time.perf_counter() - t0)
                row = stats.execute("SELECT sum(total_exec_time) * 1000 / sum(calls) FROM pg_stat_statements "
                                    "WHERE toplevel AND query LIKE %s", (f"%.{FN[v]}(%",)).fetchone()
                server[v].append(float(row[0]) if row and row[0] is not None else float("nan"))
    if a.nested:
        show_nested(dsn, one, a.per_block)  # again, after the blocks: the same work on a deeper ring
    claim.close()
    prod.close()
    print(f"load after {os.getloadavg()}")
    ref = names[0]
    for v in names:
        xs = sorted(lat[v])
        ratio = statistics.median(x / r for x, r in zip(server[v], server[ref], strict=True))
        print(f"{v:10s} server us/call median {statistics.median(server[v]):7.1f} min {min(server[v]):6.1f} "
              f"| median of per-round ratios to {ref} {ratio:.3f} | round trip p50 {xs[len(xs) // 2] * 1e3:.3f} ms"
              f"{' (with the enqueue)' if a.scenario == 'pickup' else ''}")
        if a.show_blocks:
            print(f"           blocks {[round(x) for x in server[v]]}")


if __name__ == "__main__":
    main()
