"""The claim connection's jsonb values come back as the raw JSON text, through the codec's loader.

The claimer's claim connection uses storage's raw jsonb loaders
(``use_raw_jsonb``); the binary one's ``load`` is the codec's ``raw_jsonb``. A claim on that
connection must give what storage's own raw loader gives: the args and
metadata as enqueued (JSON text bytes), NULL as None, big and non-ASCII
values intact.
"""

from __future__ import annotations

import json

import pytest
from psycopg.pq import Format

from awa_fast import _impl
from awa_fast.client import Client
from awa_fast.jobs import JobSpec
from awa_fast.runtime.claimer import Claimer, ClaimerConfig
from awa_fast.storage import types as storage_types
from tests.integration.storage_helpers import claim

PAYLOADS = [
    {"n": 1},
    {"text": "ünïcødé ✓ 日本", "nested": {"a": [1, 2.5, None, True, {"b": "c"}]}},
    {"big": "x" * 300_000},
    [],
    "just a string",
]


def _claimer(pg_dsn: str, schema: str) -> Claimer:
    cfg = ClaimerConfig(pg_dsn, schema, "cj", concurrency=4, listen=False)
    return Claimer(cfg, {"cj.work": JobSpec("cj.work", lambda job: None, "cj", 2, 3, False, None)},
                   watch_parent=False)


def test_the_claim_connection_loads_binary_jsonb_with_the_codec(pg_dsn: str, schema: str) -> None:
    claimer = _claimer(pg_dsn, schema)
    conn = claimer._claim_connection()  # noqa: SLF001 - the connection the claim loop claims on
    try:
        loader = conn.adapters.get_loader(conn.adapters.types["jsonb"].oid, Format.BINARY)
        raw_loader = storage_types._RawJsonbBinaryLoader  # noqa: SLF001 - the loader use_raw_jsonb registers
        assert loader is raw_loader and raw_loader.load is _impl.raw_jsonb
    finally:
        conn.close()


@pytest.mark.parametrize("with_metadata", [False, True])
def test_claimed_jsonb_is_the_enqueued_json(pg_dsn: str, schema: str, storage, with_metadata: bool) -> None:  # noqa: ANN001
    client = Client(pg_dsn, schema)
    try:
        ids = [client.enqueue("cj.work", p, queue="cj", metadata={"trace": i, "tag": "é"} if with_metadata else None)
               for i, p in enumerate(PAYLOADS)]
        claimer = _claimer(pg_dsn, schema)
        claim_conn = claimer._claim_connection()  # noqa: SLF001
        try:
            snaps = claim(storage, claim_conn, "cj", limit=len(PAYLOADS))
        finally:
            claim_conn.close()
    finally:
        client.close()
    assert sorted(s.job_id for s in snaps) == sorted(ids)
    by_id = {s.job_id: s for s in snaps}
    for i, (job_id, payload) in enumerate(zip(ids, PAYLOADS, strict=True)):
        s = by_id[job_id]
        assert type(s.args) is bytes and json.loads(s.args) == payload
        if with_metadata:
            assert type(s.metadata) is bytes and json.loads(s.metadata) == {"trace": i, "tag": "é"}
        else:
            assert s.metadata is None
        assert s.errors is None and s.callback_result is None and s.progress is None
