"""Process entry points: the claimer process the supervisor forks, and dying with the parent."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from awa_fast.runtime.claimer import ClaimerConfig


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM (a drain) to this child when the supervisor dies."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the claim loop's getppid check still applies
        pass


def claimer_main(app_ref: str, config: ClaimerConfig, shm_name: str | None, shm_index: int) -> None:
    """Entry point of a claimer process (forked by the supervisor): run one claimer, exit with its code."""
    import signal

    from awa_fast.runtime.claimer import Claimer
    from awa_fast.runtime.loader import load_app

    die_with_parent()
    app = load_app(app_ref)
    record = None
    ring = None
    if shm_name:
        from awa_fast.runtime.shm import ShmRing

        ring = ShmRing.attach(shm_name)
        record = ring.claimer(shm_index)
    claimer = Claimer(config, app.registry, record, getattr(app, "flush_listeners", ()))
    signal.signal(signal.SIGTERM, lambda *_: claimer.stop())
    signal.signal(signal.SIGINT, lambda *_: claimer.stop())
    code = claimer.run()
    if ring is not None:
        ring.close()
    os._exit(code)
