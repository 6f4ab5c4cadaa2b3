"""Binary COPY streams the storage layer builds in plain Python (result-carrying completions)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from awa_fast.jobs import ClaimSnapshot

_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
_COPY_TRAILER = b"\xff\xff"
# 10 fields: ready_slot int2, job_id int8, lane_id int4, lane_seq int8, run_lease int4, attempt int2, state int2
_DONE_RESULT_HEAD = struct.Struct(">hihiqiiiqiiihih")


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
