"""The app of the cron failover scenario: ``tests.chaos.cron_app:app``.

One per-second schedule (missed ticks coalesced) firing a trivial handler.
The supervisor syncs it to the database when it starts.
"""

from __future__ import annotations

from awa_fast.app import App

app = App(dsn=None, schema="awa_fast", default_queue="q")


@app.periodic("* * * * * *", name="per_second")
@app.job("cron.tick", queue="q")
def tick(job):  # noqa: ANN001, ANN201 - awa_fast.jobs.Job
    return None
