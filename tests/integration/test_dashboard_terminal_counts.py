"""The dashboard reads the terminal counts at most once per window, however many pages poll.

``queue_terminal_counts`` counts the live history (``done_entries`` rows grow with
traffic times retention), so the backend shares one read between its sampler and
every overview poll, and widens the window after a slow read. The backend's clock is
replaced by one the test moves, so the windows are exact and nothing sleeps; the reads
themselves run against the real PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from awa_fast import App
from awa_fast.storage import Storage
from awa_fast.web.backend import TERMINAL_SHARE, Backend

Q = "dashcounts"


class Clock:
    """A clock the test sets; ``read_cost`` seconds pass inside every terminal-counts read."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.read_cost = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backend(pg_dsn: str, schema: str) -> Iterator[tuple[Backend, Clock, list[float], App]]:
    """A Backend (sampler not started) on the test schema, its clock, and the clock at each read."""
    app = App(pg_dsn, schema)
    app.migrate()
    b = Backend(app, pg_dsn, None, sample_every=0.5)
    clock, reads = Clock(), []

    class CountedStorage(Storage):
        """The real storage; each terminal-counts read noted with the clock, which it moves on."""

        def queue_terminal_counts(self, conn: Any) -> dict[str, dict[str, int]]:
            reads.append(clock.now)
            out = super().queue_terminal_counts(conn)
            clock.now += clock.read_cost
            return out

    b.storage = CountedStorage(schema)
    b._clock = clock
    try:
        yield b, clock, reads, app
    finally:
        b.close()
        app.close()


def test_overview_polls_and_samples_share_one_read_per_window(backend):
    b, clock, reads, _app = backend
    b.sample()
    for _ in range(5):  # five open pages poll within the window: no new read
        clock.now += 0.05
        b.overview()
    assert len(reads) == 1
    clock.now = reads[0] + 0.8 * b.sample_every  # the window of a cheap read: 0.8 x sample_every
    b.overview()
    b.sample()
    assert len(reads) == 2


def test_a_slow_read_widens_the_window_to_keep_the_dashboards_share(backend):
    b, clock, reads, _app = backend
    clock.read_cost = 2.0  # each read takes 2 s: the next may start 2 / TERMINAL_SHARE = 40 s later
    b.sample()
    end = reads[0] + clock.read_cost / TERMINAL_SHARE
    calls = 0
    while clock.now + 1.0 < end:  # the sampler's and pages' calls, a second apart, read nothing
        clock.now += 1.0
        b.sample()
        b.overview()
        calls += 2
    assert reads == [1000.0] and calls >= 70
    clock.now = end
    b.overview()
    assert len(reads) == 2


def test_the_chart_rate_is_counted_over_the_reads_and_carried_between_them(backend):
    b, clock, reads, app = backend

    @app.job("dash.done", queue=Q)
    def done(job: Any) -> None:
        return None

    first = b.sample()
    assert first["completed_per_s"] is None  # one read: no rate yet
    for i in range(6):
        app.enqueue("dash.done", {"i": i})
    summary = app.run_worker([Q], until_empty=True, install_signal_handlers=False, maintenance=False)
    assert summary.completed == 6
    clock.now += 3.0
    assert b.sample()["completed_per_s"] == pytest.approx(6 / 3.0)
    clock.now += 0.1  # inside the window: no read, the last rate carried
    assert b.sample()["completed_per_s"] == pytest.approx(2.0) and len(reads) == 2
    clock.now += 1.0
    assert b.sample()["completed_per_s"] == 0.0 and len(reads) == 3
