"""``copy_rows.copy_blocks``: the streamed COPY of a bulk enqueue is byte for byte the one-buffer COPY."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from awa_fast import _impl
from awa_fast.client import encode_payloads
from awa_fast.errors import PayloadError
from awa_fast.storage.copy_rows import COPY_BLOCK, copy_blocks
from awa_fast.storage.types import LaneRange

RNG = LaneRange(lane_id=5, first_seq=1000, ready_slot=3)


def _encode(block: Sequence[Any]) -> list[bytes]:
    return encode_payloads(block)


@pytest.mark.parametrize("n", [0, 1, COPY_BLOCK - 1, COPY_BLOCK, COPY_BLOCK + 1, 3 * COPY_BLOCK + 17])
@pytest.mark.parametrize("metadata", [None, b'{"m":1}'])
def test_blocks_join_into_the_one_buffer_stream(n: int, metadata: bytes | None) -> None:
    items = [{"i": i, "pad": "é" * (i % 5)} for i in range(n)]
    streamed = b"".join(bytes(b) for b in copy_blocks(RNG, "some.kind", items, metadata, 7, _encode))
    whole = _impl.encode_ready_rows(RNG.ready_slot, RNG.lane_id, RNG.first_seq, "some.kind", encode_payloads(items),
                                    metadata, 0, 7)
    assert streamed == whole


def test_an_encode_error_surfaces_at_its_block_after_the_earlier_ones() -> None:
    items: list[Any] = [{"i": i} for i in range(2 * COPY_BLOCK)]
    items[COPY_BLOCK + 3] = {"bad": float("nan")}
    gen = copy_blocks(RNG, "k", items, None, 1, _encode)
    empty = _impl.encode_ready_rows(RNG.ready_slot, RNG.lane_id, RNG.first_seq, "k", [], None, 0, 1)
    assert bytes(next(gen)) == empty[:-2]  # the header
    first = next(gen)  # the first block is ready before the second one is looked at
    assert len(first) > 0
    with pytest.raises(PayloadError):
        next(gen)


def test_an_encoder_that_loses_items_is_refused() -> None:
    gen = copy_blocks(RNG, "k", [{"i": 1}, {"i": 2}], None, 1, lambda block: encode_payloads(block)[:1])
    next(gen)
    with pytest.raises(RuntimeError, match="1 payloads for 2 items"):
        next(gen)
