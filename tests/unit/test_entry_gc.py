"""The claimer process's collector set-up (``runtime.entry.tune_gc``), in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import gc, json
from awa_fast.runtime.entry import CLAIMER_GC_THRESHOLD, tune_gc
before = (gc.get_threshold(), gc.get_freeze_count())
held = [[i] for i in range(1000)]  # objects alive before the set-up: frozen out of the collector's reach
tune_gc()
cycle = []
cycle.append(cycle)  # a cycle made after it is still collectable
del cycle
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "limit": CLAIMER_GC_THRESHOLD, "collected": gc.collect(), "held": len(held)}))
"""


def test_tune_gc_freezes_the_loaded_heap_and_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    (young, older, oldest), frozen_before = got["before"]
    assert got["after"] == [got["limit"], older, oldest] and got["limit"] > young
    assert frozen_before == 0 and got["frozen"] >= 1000
    assert got["collected"] >= 1  # frozen is not disabled: new garbage cycles are still found
