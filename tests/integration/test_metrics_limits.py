"""Flow-control state in the metrics (issue 14 item 5): max_running, running, rate and tokens per queue."""

from __future__ import annotations

import time

import pytest

from awa_fast.client import Client
from awa_fast.limits import Rate
from awa_fast.metrics import StorageGauges, _storage_metrics

pytestmark = pytest.mark.integration

Q = "limited"


def _samples(gauges: StorageGauges) -> dict[str, dict[str, float]]:
    gauges.refresh_once()
    assert gauges.error is None, gauges.error
    return {f.name: {s.labels["queue"]: s.value for s in f.samples} for f in _storage_metrics(gauges)
            if f.name.startswith("awa_fast_queue_")}


def test_limited_queues_export_their_limit_running_count_and_tokens(pg_dsn, schema, storage, conn):
    gauges = StorageGauges(pg_dsn, schema)
    none = _samples(gauges)
    assert none["awa_fast_queue_max_running"] == {} and none["awa_fast_queue_rate_tokens"] == {}
    storage.queue_limits_set(conn, Q, max_running=3, max_rate=Rate(20, per=2.0, burst=5))
    client = Client(pg_dsn, schema)
    client.enqueue_many("m.work", [{} for _ in range(6)], queue=Q)
    client.close()
    before = _samples(gauges)
    assert before["awa_fast_queue_max_running"] == {Q: 3.0}
    assert before["awa_fast_queue_running"] == {Q: 0.0}
    assert before["awa_fast_queue_rate_limit_per_second"] == {Q: 10.0}
    spent_at = time.monotonic()  # before the claim's now(): the refill below is bounded by what follows
    claimed, _ = storage.lane_claim_limited_result(conn, Q, 10, 0, 1)
    assert len(claimed) == 3  # max_running cuts the claim
    after = _samples(gauges)
    refill = 10.0 * (time.monotonic() - spent_at)  # at most this many tokens came back since the claim
    assert after["awa_fast_queue_running"] == {Q: 3.0}
    assert 0.0 <= after["awa_fast_queue_rate_tokens"][Q] <= min(5.0, 5.0 - 3.0 + refill)  # 3 were spent
