"""The Prometheus collector over a real shared-memory segment (no database)."""

from __future__ import annotations

import os
import time

import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="the [metrics] extra is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from awa_fast.metrics import cumulative_buckets, parse_bind, registry_for, render  # noqa: E402
from awa_fast.runtime.shm import HIST_BUCKETS, ShmRing, bucket_bounds, bucket_index  # noqa: E402


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def ring():
    r = ShmRing.create(None, [("email", 0), ("email", 1)])
    try:
        yield r
    finally:
        r.close()
        r.unlink()


def test_counters_and_histograms_come_from_the_segment(ring: ShmRing) -> None:
    rec0, rec1 = ring.claimer(0), ring.claimer(1)
    for rec in (rec0, rec1):
        rec.set_state("running", pid=os.getpid())
    rec0.add(claimed=10, completed=7, retried=2, failed=1, stale=3, claim_calls=4, batches=2)
    rec1.add(claimed=5, completed=5)
    rec0.set_in_flight(3)
    pickups = [0.0001, 0.002, 0.002, 0.5, 120.0]
    rec0.observe_latency("pickup", pickups)
    ring.publish_rings({"ready": {"current_slot": 3, "generation": 9, "slot_count": 16,
                                  "last_rotate": time.time() - 5, "prune_pruned": 2, "prune_busy": 1}},
                       leader_pid=os.getpid(), role="leader")

    body, ctype = render(registry_for(ring.snapshot))
    assert ctype.startswith("text/plain")
    s = _samples(body.decode())
    l0 = (("queue", "email"), ("stripe", "0"))
    l1 = (("queue", "email"), ("stripe", "1"))
    assert s[("awa_fast_jobs_completed_total", l0)] == 7
    assert s[("awa_fast_jobs_completed_total", l1)] == 5
    assert s[("awa_fast_jobs_claimed_total", l0)] == 10
    assert s[("awa_fast_jobs_retried_total", l0)] == 2
    assert s[("awa_fast_jobs_stale_total", l0)] == 3
    assert s[("awa_fast_claim_calls_total", l0)] == 4
    assert s[("awa_fast_completion_flushes_total", l0)] == 2
    assert s[("awa_fast_jobs_in_flight", l0)] == 3
    assert s[("awa_fast_claimer_up", l0)] == 1
    # the histogram's count is the number of samples, its buckets cumulative over the shm edges
    assert s[("awa_fast_pickup_latency_seconds_count", l0)] == len(pickups)
    assert s[("awa_fast_pickup_latency_seconds_sum", l0)] == pytest.approx(sum(pickups), rel=1e-6)
    assert s[("awa_fast_pickup_latency_seconds_bucket", (("le", "+Inf"),) + l0)] == len(pickups)
    le_60 = [k for k in s if k[0] == "awa_fast_pickup_latency_seconds_bucket" and ("le", "60.0") in k[1]
             and ("stripe", "0") in k[1]]
    assert le_60 and s[le_60[0]] == len(pickups) - 1  # 120 s is past the last edge
    assert s[("awa_fast_maintenance_leader", ())] == 1
    assert s[("awa_fast_ring_current_slot", (("ring", "ready"),))] == 3
    assert 4 < s[("awa_fast_ring_slot_age_seconds", (("ring", "ready"),))] < 60
    assert s[("awa_fast_ring_prune_slots", (("outcome", "pruned"), ("ring", "ready")))] == 2


def test_v2_histograms_counters_and_maintenance_totals_are_exported(ring: ShmRing) -> None:
    rec = ring.claimer(1)
    rec.set_state("running", pid=os.getpid())
    handler = [0.0002, 0.004, 0.004, 2.0]
    rec.publish({"claim_calls": 3, "heartbeat_failures": 2, "batches": 2},
                {"handler": handler, "flush_seconds": [0.003, 0.006], "flush_jobs": [1, 300],
                 "claim_seconds": [0.001, 0.002, 0.001], "claim_jobs": [0, 5, 296]}, waiting=4, in_flight=9)
    rec.set_abandoned(1)
    ring.publish_rings({"claim": {"current_slot": 1, "total_pruned": 6, "total_blocked": 2},
                        "lease": {"current_slot": 0, "total_empty": 3}}, os.getpid(),
                       totals={"promoted": 11, "rescued_receipt": 4, "rescued_lease": 1})
    s = _samples(render(registry_for(ring.snapshot))[0].decode())
    lv = (("queue", "email"), ("stripe", "1"))
    assert s[("awa_fast_handler_duration_seconds_count", lv)] == 4
    assert s[("awa_fast_handler_duration_seconds_sum", lv)] == pytest.approx(sum(handler))
    le = repr(bucket_bounds()[bucket_index(0.004)])  # the shm edge that holds 4 ms, as the le bound
    assert s[("awa_fast_handler_duration_seconds_bucket", (("le", le),) + lv)] == 3
    assert s[("awa_fast_completion_flush_duration_seconds_count", lv)] == 2
    assert s[("awa_fast_claim_duration_seconds_count", lv)] == 3
    # size histograms: the shm edges 0, 1, 2, 4 ... 8192 are the le bounds, cumulated
    assert s[("awa_fast_completion_flush_jobs_sum", lv)] == 301
    assert s[("awa_fast_completion_flush_jobs_bucket", (("le", "1.0"),) + lv)] == 1
    assert s[("awa_fast_completion_flush_jobs_bucket", (("le", "256.0"),) + lv)] == 1
    assert s[("awa_fast_completion_flush_jobs_bucket", (("le", "512.0"),) + lv)] == 2
    assert s[("awa_fast_claim_batch_jobs_bucket", (("le", "0.0"),) + lv)] == 1
    assert s[("awa_fast_claim_batch_jobs_bucket", (("le", "+Inf"),) + lv)] == 3
    assert s[("awa_fast_claim_batch_jobs_sum", lv)] == 301
    assert s[("awa_fast_heartbeat_failures_total", lv)] == 2
    assert (s[("awa_fast_jobs_waiting", lv)], s[("awa_fast_jobs_in_flight", lv)]) == (4, 9)
    assert s[("awa_fast_handlers_abandoned", lv)] == 1
    assert s[("awa_fast_promotions_total", ())] == 11
    assert s[("awa_fast_rescues_total", (("kind", "receipt"),))] == 4
    assert s[("awa_fast_rescues_total", (("kind", "lease"),))] == 1
    assert s[("awa_fast_prunes_total", (("outcome", "pruned"), ("ring", "claim")))] == 6
    assert s[("awa_fast_prunes_total", (("outcome", "blocked"), ("ring", "claim")))] == 2
    assert s[("awa_fast_prunes_total", (("outcome", "empty"), ("ring", "lease")))] == 3
    assert s[("awa_fast_prunes_total", (("outcome", "retained"), ("ring", "ready")))] == 0


def test_a_claimer_that_never_started_is_not_exported(ring: ShmRing) -> None:
    ring.claimer(0).set_state("running", pid=os.getpid())
    s = _samples(render(registry_for(ring.snapshot))[0].decode())
    stripes = {dict(k[1]).get("stripe") for k in s if k[0] == "awa_fast_jobs_completed_total"}
    assert stripes == {"0"}


def test_cumulative_buckets_map_the_shm_edges() -> None:
    bounds = list(bucket_bounds())
    counts = [0] * HIST_BUCKETS
    counts[0], counts[5], counts[HIST_BUCKETS - 1] = 2, 3, 1
    out = cumulative_buckets(counts, bounds)
    assert len(out) == HIST_BUCKETS and out[-1] == ("+Inf", 6.0)
    assert out[0] == (repr(bounds[0]), 2.0) and out[5][1] == 5.0 and out[-2][1] == 5.0


@pytest.mark.parametrize(("text", "expected"), [("127.0.0.1:9187", ("127.0.0.1", 9187)), (":0", ("127.0.0.1", 0)),
                                                ("9999", ("127.0.0.1", 9999)), ("[::1]:80", ("::1", 80))])
def test_parse_bind(text: str, expected: tuple[str, int]) -> None:
    assert parse_bind(text) == expected


@pytest.mark.parametrize("bad", ["host:port", "127.0.0.1:70000"])
def test_parse_bind_refuses_bad_addresses(bad: str) -> None:
    from awa_fast.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_bind(bad)
