"""A stop signal that reaches a freshly forked child before its own handlers acts on that child.

Fork copies the supervisor's SIGTERM handler into the child. Before the fix, a
SIGTERM in the window between the fork and the child's own ``signal.signal``
ran the supervisor's drain inside the child's copy: the child swallowed the
signal and went on, after signalling every sibling its copy knew of. Such a
child holds nothing yet, so it exits 0 (a clean drain): with the default
action it died by the signal, and a drain during start-up made the
supervisor exit 1 (unclean).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from awa_fast.runtime.supervisor import Supervisor, SupervisorConfig, _Child

NORMAL_END = 7  # the exit code of a child that was not stopped


def _wait_for_go(fd: int) -> None:
    """A child that has not installed any handler yet: it waits for one byte, then exits NORMAL_END."""
    os.read(fd, 1)
    os._exit(NORMAL_END)


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    sup = Supervisor(SupervisorConfig(app_ref="tests:app", dsn="", schema="awa_fast", queues=()))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, sup.request_drain)  # as Supervisor.run installs it
    signal.signal(signal.SIGINT, sup.request_drain)
    try:
        yield sup
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for child in sup._children:
            if child.process is not None and child.process.is_alive():
                child.process.kill()
                child.process.join()


def test_sigterm_before_the_child_handler_ends_that_child_only(supervisor: Supervisor) -> None:
    older_r, older_w = os.pipe()
    young_r, young_w = os.pipe()
    older = _Child("older", _wait_for_go, (older_r,))
    young = _Child("young", _wait_for_go, (young_r,))
    supervisor._children += [older, young]
    supervisor._start(older)
    supervisor._start(young)

    os.kill(young.process.pid, signal.SIGTERM)  # before "young" could install anything of its own
    young.process.join(30)
    os.write(older_w, b"g")  # the sibling goes on to its normal end
    older.process.join(30)
    os.write(young_w, b"g")  # (unread when the fix holds)

    assert young.process.exitcode == 0  # stopped before its start: clean, not killed by the signal
    assert older.process.exitcode == NORMAL_END
    assert not supervisor._draining  # the supervisor itself was not asked to stop


def test_the_supervisor_keeps_its_signal_mask_after_starting_a_child(supervisor: Supervisor) -> None:
    r, w = os.pipe()
    child = _Child("child", _wait_for_go, (r,))
    supervisor._children.append(child)
    supervisor._start(child)
    os.write(w, b"g")
    child.process.join(30)
    assert child.process.exitcode == NORMAL_END
    assert not (signal.pthread_sigmask(signal.SIG_BLOCK, set()) & {signal.SIGTERM, signal.SIGINT})
