"""A stop signal that lands inside the handler of the previous one does not deadlock.

The supervisor sends its children SIGTERM twice. The claimer's handler,
``Claimer.stop``, sets a ``threading.Event``, which holds the event's lock;
a second SIGTERM then ran the handler again in the same thread, inside that
lock, and ``Event.set`` waited on it for good (the claimer never drained; CI
printed its main thread as ``_claim_loop -> ... -> stop -> stop``). The same
state is built here by holding the event's lock in a thread and calling
``stop`` again in that thread: it must return.
"""

from __future__ import annotations

import threading

from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.runtime.maintenance import Maintenance, MaintenanceConfig


def _returns_inside_held_lock(event: threading.Event, stop: object) -> bool:
    done = threading.Event()

    def second_signal() -> None:
        with event._cond:  # noqa: SLF001 - where the first handler is when the second one lands
            stop()  # type: ignore[operator]
        done.set()

    threading.Thread(target=second_signal, daemon=True).start()  # left blocked if the bug is back
    return done.wait(5)


def test_a_second_claimer_stop_inside_the_first_returns() -> None:
    claimer = Claimer(ClaimerConfig("host=/nonexistent", "awa_fast", "q", listen=False), {}, watch_parent=False)
    claimer.stop()
    assert claimer._stopping.is_set()  # noqa: SLF001
    assert _returns_inside_held_lock(claimer._stopping, claimer.stop)  # noqa: SLF001


def test_a_second_maintenance_stop_inside_the_first_returns() -> None:
    m = Maintenance(MaintenanceConfig("host=/nonexistent", "awa_fast"))
    m.stop()
    assert _returns_inside_held_lock(m._stop, m.stop)  # noqa: SLF001
