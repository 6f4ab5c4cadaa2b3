"""Least privilege: migrations as an owner role, everything else as a runtime role without DDL."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from awa_fast.client import Client
from awa_fast.storage import Storage, use_raw_jsonb
from awa_fast.storage.migrate import RingSizes, migrate


@pytest.fixture
def roles(pg_dsn: str):
    tag = uuid.uuid4().hex[:8]
    owner, runtime, schema = f"awa_owner_{tag}", f"awa_rt_{tag}", f"sec_{tag}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE ROLE "{owner}" LOGIN')
        c.execute(f'CREATE ROLE "{runtime}" LOGIN')
        c.execute(f'GRANT CREATE ON DATABASE postgres TO "{owner}"')
    yield owner, runtime, schema
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        c.execute(f'REVOKE CREATE ON DATABASE postgres FROM "{owner}"')
        for role in (runtime, owner):
            c.execute(f'DROP OWNED BY "{role}"')
            c.execute(f'DROP ROLE "{role}"')


def test_runtime_role_without_ddl_runs_the_whole_lifecycle(pg_dsn: str, roles) -> None:
    owner, runtime, schema = roles
    owner_dsn = make_conninfo(pg_dsn, user=owner)
    rt_dsn = make_conninfo(pg_dsn, user=runtime)
    migrate(owner_dsn, schema, RingSizes(4, 4, 4))
    with psycopg.connect(owner_dsn, autocommit=True) as c:
        Storage(schema).runtime_grant(c, runtime)

    st = Storage(schema)
    with psycopg.connect(rt_dsn, autocommit=True) as rt:
        use_raw_jsonb(rt)
        # The runtime role really has no DDL and no TRUNCATE.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            rt.execute(f'CREATE TABLE "{schema}".nope (x int)')
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            rt.execute(f'TRUNCATE "{schema}".ready_entries_1')

        client = Client(rt_dsn, schema)
        first = client.enqueue("k", {"n": 1}, queue="q")          # creates a lane: DDL via SECURITY DEFINER
        client.enqueue_many("k", [{"n": i} for i in range(50)], queue="q", conn=rt)
        client.close()
        snaps = st.lane_claim(rt, "q", 100)
        assert len(snaps) == 51 and first in {s.job_id for s in snaps}
        with rt.transaction():
            assert st.receipt_complete(rt, snaps[:50]) == []
        [res] = st.attempt_close(rt, [(snaps[50], 4, 0.0, "again")])
        assert res.status == "ok"
        assert st.deferred_promote(rt) == 1
        [again] = st.lane_claim(rt, "q", 10)
        assert st.attempt_heartbeat(rt, [again])[0].status == "ok"
        with rt.transaction():
            st.receipt_complete(rt, [again], with_state=[again])
        # Rotation and TRUNCATE-based prune as the runtime role.
        assert st.ring_rotate(rt, "claim") == 1
        assert st.ring_prune(rt, "claim", 0) == "pruned"
        assert st.ring_rotate(rt, "ready") == 1
        assert st.ring_prune(rt, "ready", 0) == "pruned"
        assert st.queue_counts_exact(rt)["q"] == {"completed": 51}
        row = rt.execute("SELECT pg_try_advisory_lock(%s::int, 0)", (0,)).fetchone()
        assert row is not None
