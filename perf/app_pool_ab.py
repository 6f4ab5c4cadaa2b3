"""Client CPU of one ``App.enqueue``: the App's pool connection lent by ``pool.connection()`` against ``_Lent``.

    .venv/bin/python perf/app_pool_ab.py [--dsn DSN] [--calls 3000] [--rounds 8]

One process, one App, one schema; the two ways of lending the pool's connection alternate
block by block (``old``: psycopg_pool's ``connection()``, which also runs the connection's own
``with`` block; ``new``: ``getconn``/``putconn``). Prints the client CPU (process time) and
the wall time per call of each block, and the medians. A job to run now, the producers'
path: one prepared statement through libpq, a durable commit each.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import psycopg

from awa_fast import app as app_module
from awa_fast.app import App
from awa_fast.storage.migrate import migrate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", default=None, help="PostgreSQL (default: AWA_FAST_DSN, else the embedded server)")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    schema = "pool_ab_" + uuid.uuid4().hex[:8]
    app = App(dsn=a.dsn, schema=schema)
    dsn = app.resolve_dsn()
    migrate(dsn, schema)
    arms = {"old": lambda self, conn: self._pool().connection(),  # psycopg_pool's context manager
            "new": lambda self, conn: app_module._Lent(self._pool())}
    try:
        app.enqueue("k", {"warm": 1}, queue="q")
        out: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
        args = {"n": 0}
        for r in range(a.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                App._conn_scope = arms[name]  # type: ignore[method-assign]
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(a.calls):
                    app.enqueue("k", args, queue="q")
                out[name].append(((time.process_time() - c0) / a.calls * 1e6,
                                  (time.perf_counter() - w0) / a.calls * 1e6))
        for name, rows in out.items():
            print(f"{name}: client CPU us/call {[round(c, 1) for c, _ in rows]} "
                  f"median {statistics.median(c for c, _ in rows):.1f}; "
                  f"wall us/call median {statistics.median(w for _, w in rows):.0f}")
        ratios = [n[0] / o[0] for n, o in zip(out["new"], out["old"], strict=True)]
        print(f"new/old client CPU per round: median {statistics.median(ratios):.3f}, "
              f"{sum(r < 1 for r in ratios)} of {len(ratios)} below 1")
    finally:
        app.close()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA "{schema}" CASCADE')


if __name__ == "__main__":
    main()
