"""Client CPU of one ``App.enqueue`` (or, with ``--async``, ``App.enqueue_async``): before and after.

    .venv/bin/python perf/app_pool_ab.py [--dsn DSN] [--calls 3000] [--rounds 8] [--async]

One process, one App, one schema; the two arms alternate block by block. Prints the client
CPU (process time) and the wall time per call of each block, and the medians. A job to run
now, the producers' path: a durable commit each.

- sync: ``old`` lends the pool's connection with psycopg_pool's ``connection()``, which also
  runs the connection's own ``with`` block; ``new`` with ``getconn``/``putconn`` (``_Lent``).
  Both run the one prepared statement through libpq.
- ``--async``: ``old`` lends it with a generator context around ``pool.connection()`` and
  runs the statement through a new psycopg cursor; ``new`` lends it with ``getconn``/``putconn``
  (``_ALent``) and runs the prepared statement through libpq's asynchronous calls
  (``AsyncPoolConnection.run_prepared``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import psycopg

from awa_fast import app as app_module
from awa_fast.app import App
from awa_fast.client import Client
from awa_fast.storage.migrate import migrate


@contextlib.asynccontextmanager
async def _old_aconn_scope(self: App, conn: Any) -> AsyncIterator[Any]:
    if conn is not None:
        yield conn
        return
    pool = await self._apool()
    async with pool.connection() as c:
        yield c


SYNC_ARMS = {"old": {"_conn_scope": lambda self, conn: self._pool().connection()},
             "new": {"_conn_scope": lambda self, conn: app_module._Lent(self._pool())}}
ASYNC_ARMS = {"old": {"_aconn_scope": _old_aconn_scope, "_enqueue_single_async": Client._enqueue_single_async},
              "new": {"_aconn_scope": App._aconn_scope, "_enqueue_single_async": App._enqueue_single_async}}


async def _run(a: argparse.Namespace, app: App, arms: dict[str, dict[str, Any]],
               call: Callable[[], Awaitable[Any]]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for r in range(a.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            for attr, fn in arms[name].items():
                setattr(App, attr, fn)
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(a.calls):
                await call()
            out[name].append(((time.process_time() - c0) / a.calls * 1e6,
                              (time.perf_counter() - w0) / a.calls * 1e6))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", default=None, help="PostgreSQL (default: AWA_FAST_DSN, else the embedded server)")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--async", dest="use_async", action="store_true", help="App.enqueue_async's arms")
    a = p.parse_args()
    schema = "pool_ab_" + uuid.uuid4().hex[:8]
    app = App(dsn=a.dsn, schema=schema)
    dsn = app.resolve_dsn()
    migrate(dsn, schema)
    saved = {attr: App.__dict__[attr] for arm in (SYNC_ARMS, ASYNC_ARMS) for attr in arm["new"]}
    args = {"n": 0}

    async def sync_call() -> None:
        app.enqueue("k", args, queue="q")

    async def async_call() -> None:
        await app.enqueue_async("k", args, queue="q")

    async def both() -> dict[str, list[tuple[float, float]]]:
        try:
            if a.use_async:
                await app.enqueue_async("k", {"warm": 1}, queue="q")
                return await _run(a, app, ASYNC_ARMS, async_call)
            app.enqueue("k", {"warm": 1}, queue="q")
            return await _run(a, app, SYNC_ARMS, sync_call)
        finally:
            await app.aclose()

    try:
        out = asyncio.run(both())
        for name, rows in out.items():
            print(f"{name}: client CPU us/call {[round(c, 1) for c, _ in rows]} "
                  f"median {statistics.median(c for c, _ in rows):.1f}; "
                  f"wall us/call median {statistics.median(w for _, w in rows):.0f}")
        ratios = [n[0] / o[0] for n, o in zip(out["new"], out["old"], strict=True)]
        walls = [n[1] / o[1] for n, o in zip(out["new"], out["old"], strict=True)]
        print(f"new/old client CPU per round: median {statistics.median(ratios):.3f}, "
              f"{sum(r < 1 for r in ratios)} of {len(ratios)} below 1; "
              f"wall: median {statistics.median(walls):.3f}, {sum(r < 1 for r in walls)} of {len(walls)} below 1")
    finally:
        for attr, fn in saved.items():
            setattr(App, attr, fn)
        app.close()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA "{schema}" CASCADE')


if __name__ == "__main__":
    main()
