"""FastAPI + awa-fast: enqueue in the request's transaction, work the jobs in the app's lifespan.

    DATABASE_URL=postgresql://app@db/app uvicorn main:api --app-dir examples/fastapi_app

``POST /signup {"email": ...}`` inserts a row and enqueues ``send_welcome``
in one transaction: both commit, or (an address the app refuses) neither.
The lifespan runs an in-process worker with ``run_worker_async``: its
claimers run on their own threads, the event loop only awaits them, and
uvicorn's shutdown (SIGTERM, Ctrl-C) cancels the task, which drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

import psycopg
from fastapi import FastAPI, HTTPException, Request
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from awa_fast.app import App

log = logging.getLogger("fastapi_app")
DSN = os.environ["DATABASE_URL"]
awa = App(DSN, os.environ.get("AWA_FAST_SCHEMA", "awa_fast"))


@awa.job("send_welcome", queue="email")
def send_welcome(job) -> None:  # noqa: ANN001 - a sync handler: runs on a worker thread, not on the loop
    with psycopg.connect(DSN) as conn:  # (deliver the e-mail here)
        conn.execute("UPDATE signups SET welcomed_at = now() WHERE id = %s", (job.args["signup_id"],))


def _report_worker_end(task: asyncio.Task[object]) -> None:
    # A worker that ends while the app serves (e.g. SchemaTooNew at start) must not go unnoticed.
    if not task.cancelled() and task.exception() is not None:
        log.error("the awa-fast worker stopped: %s", task.exception())


@contextlib.asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    await asyncio.to_thread(awa.migrate)  # idempotent; in production run `awa-fast migrate` before deploying
    async with AsyncConnectionPool(DSN, min_size=1, max_size=4, open=False) as pool:
        async with pool.connection() as conn:
            await conn.execute("CREATE TABLE IF NOT EXISTS signups (id bigserial PRIMARY KEY, email text NOT NULL, "
                               "welcomed_at timestamptz)")
        api.state.pool = pool
        worker = asyncio.create_task(awa.run_worker_async({"email": {"concurrency": 8}}))
        worker.add_done_callback(_report_worker_end)
        try:
            yield
        finally:
            worker.cancel()  # drains: running handlers finish, outcomes are flushed
            with contextlib.suppress(asyncio.CancelledError):
                await worker
    awa.close()


api = FastAPI(lifespan=lifespan)


class Signup(BaseModel):
    email: str


@api.post("/signup", status_code=201)
async def signup(body: Signup, request: Request) -> dict[str, int]:
    async with request.app.state.pool.connection() as conn, conn.transaction():
        cur = await conn.execute("INSERT INTO signups (email) VALUES (%s) RETURNING id", (body.email,))
        (signup_id,) = await cur.fetchone()
        job_id = await awa.enqueue_async("send_welcome", {"signup_id": signup_id}, conn=conn)
        if body.email.endswith("@invalid.example"):
            raise HTTPException(422, "address refused")  # rolls back the row and the job together
    return {"signup_id": signup_id, "job_id": job_id}


@api.get("/signup/{signup_id}")
async def signup_status(signup_id: int, request: Request) -> dict[str, bool]:
    async with request.app.state.pool.connection() as conn:
        cur = await conn.execute("SELECT welcomed_at IS NOT NULL FROM signups WHERE id = %s", (signup_id,))
        row = await cur.fetchone()
    if row is None:
        raise HTTPException(404, "no such signup")
    return {"welcomed": bool(row[0])}
