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


#: The young-generation threshold of a claimer process (CPython's default is 700).
CLAIMER_GC_THRESHOLD = 100_000


def tune_gc() -> None:
    """Set up the cyclic garbage collector of a claimer process, once its app is loaded.

    A claimer allocates a few collector-tracked objects per job (the ``Job``,
    its key, the outcome pair) that live until the job's flush. With the
    default threshold a drain ran a young collection every ~500 jobs, each
    scanning the jobs still held, and a full one over every object of the
    forked process every ~50k jobs: 10-15% of the claimer's CPU. Everything
    loaded so far (the app and its imports, inherited from the supervisor)
    is frozen out of the collector's reach, and a young collection waits for
    :data:`CLAIMER_GC_THRESHOLD` net new objects. At 10,000 a 600k-job drain
    still ran ~23 young collections per claimer at ~6 ms each (0.44 us of
    CPU per job); at 100,000 it runs 1-2 (15-19 ms each, 0.09 us per job:
    docs/performance-log.md, py-drain). Garbage cycles a handler leaves are
    still collected, after at most that many net new objects. Only the
    claimer process does this: an in-process worker leaves its host's
    collector alone.
    """
    import gc

    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(CLAIMER_GC_THRESHOLD, older, oldest)


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
    tune_gc()
    signal.signal(signal.SIGTERM, lambda *_: claimer.stop())
    signal.signal(signal.SIGINT, lambda *_: claimer.stop())
    code = claimer.run()
    if ring is not None:
        ring.close()
    os._exit(code)
