"""``--quick`` for the pyperf scripts in ``perf/``: one value per benchmark, to prove a script runs."""

from __future__ import annotations

import sys


def take_quick_flag() -> bool:
    """Remove ``--quick`` from ``sys.argv``; when it was there, ask pyperf for a single value.

    pyperf re-runs the script in worker processes with its own options, so
    the flag is only turned into ``--debug-single-value`` in the master.
    """
    if "--quick" not in sys.argv:
        return False
    sys.argv.remove("--quick")
    if "--debug-single-value" not in sys.argv and "--worker" not in sys.argv:
        sys.argv.append("--debug-single-value")
    return True
