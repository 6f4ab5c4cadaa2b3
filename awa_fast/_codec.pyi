"""Type stub for the compiled codec ``awa_fast._codec`` (source: ``cext/codec.pyx``).

Same functions, signatures and behaviour as the pure-Python twin
``awa_fast._pycodec``; pick one through ``awa_fast._impl``.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from awa_fast.jobs import AttemptClosed, ClaimSnapshot, Job

__all__ = [
    "COPY_HEADER",
    "COPY_TRAILER",
    "MAX_DEPTH_LIMIT",
    "check_payload",
    "claim_summary",
    "decode_snapshots",
    "dump_payloads",
    "encode_closure_rows",
    "encode_done_rows",
    "encode_ready_rows",
    "flush_tally",
    "new_jobs",
    "raw_jsonb",
]

COPY_HEADER: bytes
COPY_TRAILER: bytes
MAX_DEPTH_LIMIT: int

# True when ClaimSnapshot's layout was verified at import and decode_snapshots
# fills struct slots directly (False: it calls ClaimSnapshot(*row), still correct).
_fast_snapshots: bool
# True when the encoders read exact ClaimSnapshot instances from their slots.
_fast_snapshot_fields: bool
# True when Job's layout was verified at import (a probe Job built both ways agreed slot by slot)
# and new_jobs fills a Job's slots directly (False: it calls Job(...), still correct).
_fast_jobs: bool

def check_payload(obj: object, max_depth: int = 32) -> None: ...
def dump_payloads(
    objs: list[Any], start: int, out: list[bytes], max_depth: int, limit: int, dumps: Callable[[Any], Any]
) -> int: ...
def encode_ready_rows(
    ready_slot: int,
    lane_id: int,
    first_seq: int,
    kind: str,
    payloads: Sequence[bytes],
    metadata: bytes | None,
    attempt: int,
    max_attempts: int,
) -> bytes: ...
def encode_done_rows(snapshots: Sequence[ClaimSnapshot]) -> bytes: ...
def encode_closure_rows(snapshots: Sequence[ClaimSnapshot], outcome: int) -> bytes: ...
def decode_snapshots(rows: Iterable[Sequence[Any]]) -> list[ClaimSnapshot]: ...
def new_jobs(
    snapshots: Sequence[ClaimSnapshot], args_types: dict[str, type | None], runtime: Any
) -> list[Job[Any]]: ...
def flush_tally(
    pairs: Sequence[tuple[Job[Any], Any]],
    stale: set[tuple[int, int]],
    offset: float,
    committed: float,
    closed: list[AttemptClosed] | None,
) -> tuple[list[tuple[int, int]], int, dict[str, int], list[float], list[float], list[float]]: ...
def raw_jsonb(data: bytes | bytearray | memoryview) -> bytes: ...
def claim_summary(snapshots: Iterable[ClaimSnapshot]) -> tuple[dict[int, int], set[str]]: ...
