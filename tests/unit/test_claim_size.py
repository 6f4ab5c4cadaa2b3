"""The adaptive claim size of a claimer without ``batch=`` (awa_fast.runtime.claimer.next_claim_size)."""

from __future__ import annotations

from awa_fast.runtime.claimer import LOCAL_WORK_S, next_claim_size
from awa_fast.runtime.supervisor import ADAPTIVE_BATCH_MAX, parse_queue_spec


def test_full_claims_grow_to_the_ceiling_and_short_ones_shrink_to_the_floor() -> None:
    size, sizes = 64, []
    for _ in range(6):  # a deep backlog of fast handlers (1 us each)
        size = next_claim_size(size, size, size, 64, 1024, 1e-6, 64)
        sizes.append(size)
    assert sizes == [128, 256, 512, 1024, 1024, 1024]
    for _ in range(6):  # the queue drained: claims come back nearly empty
        size = next_claim_size(size, 1, size, 64, 1024, 1e-6, 64)
    assert size == 64
    # a claim between half and full keeps its size
    assert next_claim_size(256, 200, 256, 64, 1024, 1e-6, 64) == 256
    # async handlers (no measured time): grow only while the handlers starve
    assert next_claim_size(64, 64, 64, 64, 1024, None, 64, starving=True) == 128
    assert next_claim_size(64, 64, 64, 64, 1024, None, 64, starving=False) == 64


def test_slow_handlers_never_hoard_more_than_local_work_s_of_jobs() -> None:
    # 64 handlers of 10 ms each finish 640 jobs in 100 ms: the claim stops growing there
    size = 64
    for _ in range(10):
        size = next_claim_size(size, size, size, 64, 1024, 0.01, 64)
    assert size == int(64 * LOCAL_WORK_S / 0.01)
    # handlers of 1 s: never beyond the floor
    assert next_claim_size(64, 64, 64, 64, 1024, 1.0, 64) == 64


def test_a_queue_spec_without_batch_is_adaptive_and_one_with_batch_is_fixed() -> None:
    auto = parse_queue_spec("q:concurrency=32")
    assert auto.adaptive_batch and auto.claim_batch == ADAPTIVE_BATCH_MAX
    fixed = parse_queue_spec("q:concurrency=32,batch=48")
    assert not fixed.adaptive_batch and fixed.claim_batch == 48
