"""Binary COPY streams the storage layer builds in plain Python: result-carrying completions, and
the ready rows of a bulk enqueue sent a block at a time."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from awa_fast import _impl
from awa_fast.jobs import ClaimSnapshot
from awa_fast.storage.types import LaneRange

_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
_COPY_TRAILER = b"\xff\xff"
# 10 fields: ready_slot int2, job_id int8, lane_id int4, lane_seq int8, run_lease int4, attempt int2, state int2
_DONE_RESULT_HEAD = struct.Struct(">hihiqiiiqiiihih")

# Rows encoded per block of a streamed bulk enqueue: about 80 KiB of COPY data for
# small payloads, a few ms of PostgreSQL work, so the next block is ready long
# before the socket's and libpq's buffers run dry.
COPY_BLOCK = 1024
# The COPY chunks of one bulk call go to at most this many successive enqueue shards
# (lanes) of the queue, and to at most half its shards (at least 1): chunk k to shard
# (backend pid + k mod min(COPY_LANES, shards / 2)), in the lane_reserve query. Enough
# lanes for a few stripes to claim side by side, and few enough that one big call never
# holds every shard's lock (8 shards by default).
COPY_LANES = 4


def copy_blocks(rng: LaneRange, kind: str, items: Sequence[Any], metadata: bytes | None, max_attempts: int,
                encode: Callable[[Sequence[Any]], Sequence[bytes]] | None) -> Iterator[bytes | memoryview]:
    """The binary COPY stream of ``ready_entries`` rows for ``items`` in ``rng``.

    Without ``encode``, ``items`` are encoded payloads and the stream is one
    buffer, built before the first write (an error leaves the transaction
    clean). With it, a block at a time: the header, then the rows of each
    block of :data:`COPY_BLOCK` items (``encode(block)`` gives their
    payloads, ``encode_ready_rows`` the rows; a view of its buffer without
    its own header and trailer), then the trailer. Whatever ``encode``
    raises propagates at that block.
    """
    if encode is None:
        return iter([_impl.encode_ready_rows(rng.ready_slot, rng.lane_id, rng.first_seq, kind, items, metadata, 0,
                                             max_attempts)])
    return _streamed_blocks(rng, kind, items, metadata, max_attempts, encode)


def _streamed_blocks(rng: LaneRange, kind: str, items: Sequence[Any], metadata: bytes | None, max_attempts: int,
                     encode: Callable[[Sequence[Any]], Sequence[bytes]]) -> Iterator[bytes | memoryview]:
    head, tail = len(_COPY_HEADER), len(_COPY_TRAILER)
    yield _COPY_HEADER
    for start in range(0, len(items), COPY_BLOCK):
        part = items[start:start + COPY_BLOCK]
        payloads = encode(part)
        if len(payloads) != len(part):
            raise RuntimeError(f"encode gave {len(payloads)} payloads for {len(part)} items")
        buf = _impl.encode_ready_rows(rng.ready_slot, rng.lane_id, rng.first_seq + start, kind, payloads, metadata,
                                      0, max_attempts)
        yield memoryview(buf)[head:len(buf) - tail]
    yield _COPY_TRAILER


def encode_done_result_rows(items: Sequence[tuple[ClaimSnapshot, bool, bytes]]) -> bytes:
    """Binary COPY stream for ``done_entries (ready_slot, job_id, lane_id, lane_seq, run_lease,
    attempt, state, queue, kind, result)``: completed rows with the handler's result (raw JSON).

    Plain Python: only result-carrying completions use it; the common ones
    go through the accelerated ``encode_done_rows``.
    """
    parts = [_COPY_HEADER]
    append = parts.append
    pack = _DONE_RESULT_HEAD.pack
    texts: dict[str, bytes] = {}
    for s, _, result in items:
        append(pack(10, 2, s.ready_slot, 8, s.job_id, 4, s.lane_id, 8, s.lane_seq, 4, s.run_lease, 2, s.attempt,
                    2, 1))
        for text in (s.queue, s.kind):
            field = texts.get(text)
            if field is None:
                raw = text.encode("utf-8")
                field = texts[text] = len(raw).to_bytes(4, "big") + raw
            append(field)
        if result is None:
            append(b"\xff\xff\xff\xff")  # NULL
        else:
            data = bytes(result)
            append((len(data) + 1).to_bytes(4, "big") + b"\x01" + data)  # jsonb binary: version 1, then the text
    append(_COPY_TRAILER)
    return b"".join(parts)
