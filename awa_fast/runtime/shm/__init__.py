"""The supervisor's shared-memory segment: the ring section and the claimers' status records.

The supervisor creates one fixed-layout segment; claimer processes and the
maintenance process attach to it by name, ``awa-fast status`` and the
metrics exporter read it. Two sections:

- the **ring section** (:meth:`ShmSegment.publish_rings`,
  :meth:`ShmSegment.read_rings`): the local maintenance process publishes
  the leader, each ring's current slot, rotation and prune outcomes, and its
  promotion and rescue totals. Today it is a mirror for dashboards:
  PostgreSQL stays the authority and nothing reads it back to decide.
- the **status section**, one :class:`StatusRecord` per claimer: state,
  pid, heartbeat (last alive), counters, gauges and fixed-bucket
  histograms, published once per flush or idle claim loop.

Modules: :mod:`~awa_fast.runtime.shm.layout` (bytes, names, errors),
:mod:`~awa_fast.runtime.shm.histogram` (buckets and percentiles),
:mod:`~awa_fast.runtime.shm.records` (seqlock, status records, ring
values), :mod:`~awa_fast.runtime.shm.segment` (create, attach, sweep of
dead owners' segments), :mod:`~awa_fast.runtime.shm.locator` (finding the
local supervisors' segments).
"""

from __future__ import annotations

from awa_fast.runtime.shm.histogram import (
    HIST_BUCKETS,
    SIZE_BUCKETS,
    SIZE_EDGES,
    TIME_EDGES,
    bucket_bounds,
    bucket_index,
    histogram_percentiles,
    size_bounds,
    size_bucket_index,
)
from awa_fast.runtime.shm.layout import (
    CLAIMER_STATES,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    LAYOUT_VERSION,
    PRUNE_OUTCOMES,
    RING_FIELDS,
    RINGS,
    SIZE_HISTOGRAMS,
    TIME_HISTOGRAMS,
    TOTALS,
    ShmError,
    ShmLayoutError,
    ShmNotFound,
    segment_size,
)
from awa_fast.runtime.shm.locator import read_locator, read_locators, remove_locator, write_locator
from awa_fast.runtime.shm.records import (
    RingSnapshot,
    RingState,
    StatusRecord,
    prune_outcome_counts,
    prune_outcome_fields,
)
from awa_fast.runtime.shm.segment import ShmSegment, segment_name, segment_owner, sweep_dead_segments

# The names of layout version 1, still imported by callers.
ShmRing = ShmSegment
ClaimerRecord = StatusRecord

__all__ = [
    "CLAIMER_STATES",
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "HIST_BUCKETS",
    "LAYOUT_VERSION",
    "PRUNE_OUTCOMES",
    "RINGS",
    "RING_FIELDS",
    "SIZE_BUCKETS",
    "SIZE_EDGES",
    "SIZE_HISTOGRAMS",
    "TIME_EDGES",
    "TIME_HISTOGRAMS",
    "TOTALS",
    "ClaimerRecord",
    "RingSnapshot",
    "RingState",
    "ShmError",
    "ShmLayoutError",
    "ShmNotFound",
    "ShmRing",
    "ShmSegment",
    "StatusRecord",
    "bucket_bounds",
    "bucket_index",
    "histogram_percentiles",
    "prune_outcome_counts",
    "prune_outcome_fields",
    "read_locator",
    "read_locators",
    "remove_locator",
    "segment_name",
    "segment_owner",
    "segment_size",
    "size_bounds",
    "size_bucket_index",
    "sweep_dead_segments",
    "write_locator",
]
