"""A quiet queue's claim lets the worker it woke take the GIL at once; a busy claimer never gives it up.

At 200 jobs/s every claim finds the pool idle: the claim thread hands the job
to a worker and then does its bookkeeping (counters, the LISTEN poll) before
it blocks, and the woken worker waited for the GIL all that time (~0.1 ms of
the pickup, docs/performance-log.md, 2026-12-07 hand-off). So after a short
claim, on its way to sleep, the claim thread releases the GIL once, but only
when nothing else was held: with jobs running, or with another claim to make
at once, the GIL would go to a busy worker and the claim loop would wait for
it in the middle of a drain.

The claimer runs its claim loop without a server: its claim connection and
claim call are stand-ins that return scripted claims (nothing connects), and
the executor's threads are not started, so dispatched jobs stay held.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import pytest

from awa_fast import App
from awa_fast.jobs import ClaimSnapshot
from awa_fast.runtime import claimer as claimer_mod
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from tests.unit.test_codec import snapshot

DSN = "host=/nonexistent"


def _snapshot(i: int) -> ClaimSnapshot:
    return snapshot(i, queue="q", kind="k")  # the codec tests' snapshot, of this claimer's queue and kind


def _run(script: Sequence[list[ClaimSnapshot]],
         monkeypatch: pytest.MonkeyPatch) -> tuple[Claimer, list[tuple[int, int]]]:
    """Run a claim loop whose claims return ``script`` in turn (then it stops); its yields, each
    as (claim calls so far, chunks queued for the executor at that moment)."""
    app = App()
    app.job("k", queue="q")(lambda job: None)
    c = Claimer(ClaimerConfig(DSN, "awa_fast", "q", listen=False, poll_interval=0.001), dict(app.registry),
                watch_parent=False)
    calls: list[int] = []
    yields: list[tuple[int, int]] = []

    def claim(conn: Any, queue: str, want: int, stripe: int, stripes: int) -> tuple[list[ClaimSnapshot], bool]:
        calls.append(want)
        if len(calls) > len(script):
            c.stop()
            return [], False
        return script[len(calls) - 1], False

    monkeypatch.setattr(c, "_claim_connection", lambda: object())
    monkeypatch.setattr(c, "limits", types.SimpleNamespace(claim_call=lambda conn: claim))  # a queue without limits
    monkeypatch.setattr(claimer_mod, "let_woken_workers_run",
                        lambda: yields.append((len(calls), c.executor._work.qsize())))  # noqa: SLF001
    c._clock_measured = float("inf")  # noqa: SLF001 - no clock read (it would connect)
    c._claim_loop()  # noqa: SLF001
    return c, yields


def test_a_short_claim_to_an_idle_pool_yields_once_after_its_work_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    c, yields = _run([[_snapshot(1)]], monkeypatch)
    assert yields == [(1, 1)]  # after the first claim, with its job already handed to the executor
    assert c.outstanding == 1


def test_a_claim_while_jobs_are_held_keeps_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    _, yields = _run([[_snapshot(1)], [_snapshot(2)], [_snapshot(3), _snapshot(4)]], monkeypatch)
    assert yields == [(1, 1)]  # the later short claims found job 1 still held


def test_a_full_claim_goes_on_claiming_without_yielding(monkeypatch: pytest.MonkeyPatch) -> None:
    full = [_snapshot(i) for i in range(16)]  # the floor size asked for (max(16, concurrency) at most)
    _, yields = _run([full], monkeypatch)
    assert yields == []  # a backlog may remain: the loop claims again at once
