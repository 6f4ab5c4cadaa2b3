"""A stop signal that lands while its thread holds the stop event's lock does not deadlock.

A stop handler runs on the main thread, between two bytecodes of whatever
that thread was doing. With a ``threading.Event`` as the stop flag its
``set`` takes the event's lock, which is not re-entrant and which the main
thread itself holds inside ``Event.wait`` (``Condition.wait`` holds it just
before and after it blocks: the claim loop's and maintenance's waits) and
inside ``Event.set`` (a second SIGTERM in the first one's handler: the
supervisor signals twice; CI printed the claimer's main thread as
``_claim_loop -> ... -> stop -> stop``). The handler then waited on that lock
for good and the process was SIGKILLed. The state is built here by holding
the lock a waiter holds, if the flag has one, in a thread and calling
``stop`` in that same thread: it must return, and a waiter must wake.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from awa_fast import App
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig
from awa_fast.runtime.supervisor import QueueSpec
from awa_fast.worker import Worker, WorkerConfig

DSN = "host=/nonexistent"


def _lock_a_waiter_holds(flag: Any) -> contextlib.AbstractContextManager[Any]:
    """A ``threading.Event``'s condition (held by ``Event.wait`` and ``Event.set``); a lock-free flag has none."""
    cond = getattr(flag, "_cond", None)
    return cond if cond is not None else contextlib.nullcontext()


def _returns_inside_held_lock(flag: Any, stop: Callable[[], None]) -> bool:
    done = threading.Event()

    def signal_lands() -> None:
        with _lock_a_waiter_holds(flag):  # where the main thread is when the signal lands
            stop()
        done.set()

    threading.Thread(target=signal_lands, daemon=True).start()  # left blocked if the bug is back
    return done.wait(5)


def _first_stop_wakes_a_waiter(flag: Any, stop: Callable[[], None]) -> None:
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(flag.wait(5)), daemon=True)
    waiter.start()
    assert _returns_inside_held_lock(flag, stop)
    waiter.join(5)
    assert woke == [True]


def _claimer() -> Claimer:
    return Claimer(ClaimerConfig(DSN, "awa_fast", "q", listen=False), {}, watch_parent=False)


def test_a_first_claimer_stop_inside_the_claim_loops_wait_returns_and_wakes_it() -> None:
    claimer = _claimer()
    _first_stop_wakes_a_waiter(claimer._stopping, claimer.stop)  # noqa: SLF001
    assert claimer._wake.is_set()  # noqa: SLF001 - the claim loop's sleep ends too


def test_a_second_claimer_stop_inside_the_first_returns() -> None:
    claimer = _claimer()
    claimer.stop()
    assert claimer._stopping.is_set()  # noqa: SLF001
    assert _returns_inside_held_lock(claimer._stopping, claimer.stop)  # noqa: SLF001


def test_a_first_maintenance_stop_inside_its_wait_returns_and_wakes_it() -> None:
    m = Maintenance(MaintenanceConfig(DSN, "awa_fast"))
    _first_stop_wakes_a_waiter(m._stop, m.stop)  # noqa: SLF001


def test_a_second_maintenance_stop_inside_the_first_returns() -> None:
    m = Maintenance(MaintenanceConfig(DSN, "awa_fast"))
    m.stop()
    assert _returns_inside_held_lock(m._stop, m.stop)  # noqa: SLF001


def _worker() -> Worker:
    return Worker(App(DSN, "awa_fast"), WorkerConfig(DSN, "awa_fast", (QueueSpec("q"),), maintenance=False))


def test_a_first_worker_stop_inside_the_wait_on_its_kick_returns_and_wakes_it() -> None:
    worker = _worker()
    # Worker.wait (the main thread under run_worker's handlers) waits on the kick
    _first_stop_wakes_a_waiter(worker._kick, worker.stop)  # noqa: SLF001
    assert worker._stopping.is_set()  # noqa: SLF001


def test_a_worker_stop_before_start_reaches_the_claimers_start_creates() -> None:
    # start() calls stop() again when a stop came before its claimers existed
    worker = _worker()
    worker.stop()
    claimer = _claimer()
    worker.claimers.append(claimer)
    worker.stop()
    assert claimer._stopping.is_set()  # noqa: SLF001
