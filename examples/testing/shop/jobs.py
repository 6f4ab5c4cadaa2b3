"""The shop's awa-fast app and its handlers."""

from __future__ import annotations

import os

import psycopg

import awa_fast
from awa_fast.app import App

# Tests never touch this DSN: the awa_app fixture points the app at a fresh test schema.
app = App(os.environ.get("DATABASE_URL"))


@app.job("send_receipt", queue="email", max_attempts=5)
def send_receipt(job) -> None:  # noqa: ANN001
    if "@" not in job.args["email"]:
        raise awa_fast.TerminalError(f"cannot mail {job.args['email']!r}")
    with psycopg.connect(app.dsn) as conn:  # (send the e-mail here)
        conn.execute("UPDATE orders SET receipt_sent = true WHERE id = %s", (job.args["order_id"],))


@app.job("reserve_stock", queue="stock")
async def reserve_stock(job) -> awa_fast.RetryAfter | None:  # noqa: ANN001
    if job.args["quantity"] > 100:
        return awa_fast.RetryAfter(3600, "waiting for the next delivery")
    return None
