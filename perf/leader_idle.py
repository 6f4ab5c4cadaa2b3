"""What the maintenance leader costs while nothing happens: every slot asked at each pass, or only the dirty ones.

One schema, one real leader (``Maintenance``) driven as its ``run`` loop drives it (``run_once``
every tick) on an idle schema. Two arms alternate in blocks (AB BA ...), each a fresh leadership:

* ``every``: ``prune_recheck_interval=0``, so each prune pass asks every sealed slot of every ring
  (``ring_prune``), what the leader did before slots were known clean;
* ``clean``: the default, where a slot found empty or pruned is asked again only once it has been
  current again, a rotation met rows in it, or the recheck interval (15 s) passed.

Per block, each per second of wall time: the prune calls (``ring_prune`` and, for the ready ring
with its history retention, ``ring_prune_retained``; counted in the leader's ``Storage``), the
passes, the leader thread's CPU (``time.thread_time``) and its backend's CPU (``/proc``, so the
server must be local). The first pass of each leadership asks every slot in
both arms and is not counted.

    .venv/bin/python perf/leader_idle.py --dsn DSN [--schema bench_leader_idle] [--seconds 10] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import psycopg
from claim_segment_ab import backend_cpu  # perf/ is on the path when this runs as a script

from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig
from awa_fast.storage import Storage, connect
from awa_fast.storage.migrate import migrate


class CountingStorage(Storage):
    """The leader's storage, counting its ``ring_prune`` and ``ring_prune_retained`` calls."""

    __slots__ = ("prunes",)

    def __init__(self, schema: str) -> None:
        super().__init__(schema)
        self.prunes = 0

    def ring_prune(self, conn: psycopg.Connection, ring: str, slot: int, lock_timeout_ms: int = 50) -> str:
        self.prunes += 1
        return super().ring_prune(conn, ring, slot, lock_timeout_ms)

    def ring_prune_retained(self, conn: psycopg.Connection, ring: str, slot: int, retain_s: float,
                            lock_timeout_ms: int = 50) -> str:
        self.prunes += 1
        return super().ring_prune_retained(conn, ring, slot, retain_s, lock_timeout_ms)


def block(dsn: str, schema: str, recheck: float | None, seconds: float) -> dict[str, float]:
    """One leadership of ``seconds`` on the idle schema; its rates per second of wall time."""
    cfg = MaintenanceConfig(dsn, schema) if recheck is None else \
        MaintenanceConfig(dsn, schema, prune_recheck_interval=recheck)
    leader = Maintenance(cfg)
    storage = leader.storage = CountingStorage(schema)
    assert leader.try_lead(), "another maintenance leader holds this schema"
    conn = leader._conn  # noqa: SLF001 - the leader's own session, for its backend pid
    assert conn is not None
    pid = conn.info.backend_pid
    tick = min(cfg.promote_interval, cfg.prune_interval, cfg.election_interval)
    leader.run_once()  # the first pass asks every slot in both arms: not counted
    storage.prunes = 0
    b0, c0, t0 = backend_cpu(pid), time.thread_time(), time.monotonic()
    passes = 0
    while time.monotonic() - t0 < seconds:
        leader.run_once()
        passes += 1
        time.sleep(tick)
    wall = time.monotonic() - t0
    out = {"prune_calls_per_s": storage.prunes / wall, "passes_per_s": passes / wall,
           "leader_cpu_ms_per_s": (time.thread_time() - c0) * 1e3 / wall,
           "backend_cpu_ms_per_s": (backend_cpu(pid) - b0) * 1e3 / wall}
    leader.resign()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", required=True)
    p.add_argument("--schema", default="bench_leader_idle")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    if not a.schema.startswith("bench"):
        raise SystemExit("--schema must start with 'bench' (it is dropped and migrated anew)")
    with connect(a.dsn) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{a.schema}" CASCADE')
    migrate(a.dsn, a.schema)
    arms = {"every": 0.0, "clean": None}
    res: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
    for r in range(a.rounds):
        for name in (("every", "clean") if r % 2 == 0 else ("clean", "every")):
            res[name].append(block(a.dsn, a.schema, arms[name], a.seconds))
            print(f"round {r} {name:5s} " + "  ".join(f"{k} {v:6.2f}" for k, v in res[name][-1].items()), flush=True)
    for name, rows in res.items():
        print(f"{name:5s} medians: " + "  ".join(f"{k} {statistics.median(x[k] for x in rows):6.2f}"
                                                  for k in rows[0]))


if __name__ == "__main__":
    main()
