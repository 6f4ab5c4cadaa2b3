"""Hostile-user hardening (issue 9 items 6, 7, 8): the definer functions, EXECUTE grants, passwords.

- A runtime role cannot make a SECURITY DEFINER function (ring_prune) move a
  sequence it names: it cannot rewrite the lane cursors' identity, and even a
  claim head pointing at a foreign sequence is ignored by prune.
- No awa-fast function is executable by a role that was not granted it
  (every function of the schema, enumerated from pg_proc); reserved schema
  names are refused with one line.
- The password of a DSN shows neither in ``ps`` of a supervisor and its
  children, nor in the repr of a runtime config, nor in the error about a
  DSN libpq cannot parse.
"""

from __future__ import annotations

import pathlib
import subprocess
import uuid

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from awa_fast.client import Client
from awa_fast.errors import ConfigError, InvalidName
from awa_fast.runtime.batcher import BatcherConfig
from awa_fast.runtime.claimer import ClaimerConfig
from awa_fast.runtime.heartbeat import HeartbeatConfig
from awa_fast.runtime.maintenance import MaintenanceConfig
from awa_fast.runtime.supervisor import QueueSpec, SupervisorConfig
from awa_fast.storage import Storage, connect, use_raw_jsonb
from awa_fast.storage.migrate import RingSizes, migrate
from awa_fast.storage.schema import latest_version, migrations, render, validate_schema
from tests.fixtures.database import migrate_before
from tests.fixtures.supervisor import SupervisorProc, pid_alive
from tests.integration.runtime_helpers import cli

pytestmark = pytest.mark.integration


@pytest.fixture
def roles(pg_dsn: str):
    """An owner that migrates, a runtime role, a role with no grants, and an application schema."""
    tag = uuid.uuid4().hex[:8]
    owner, runtime, stranger = f"awa_owner_{tag}", f"awa_rt_{tag}", f"awa_none_{tag}"
    schema, app_schema = f"sec_{tag}", f"app_{tag}"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        for role in (owner, runtime, stranger):
            c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        c.execute(sql.SQL("GRANT CREATE ON DATABASE postgres TO {}").format(sql.Identifier(owner)))
    yield {"owner": owner, "runtime": runtime, "stranger": stranger, "schema": schema, "app_schema": app_schema,
           "owner_dsn": make_conninfo(pg_dsn, user=owner), "rt_dsn": make_conninfo(pg_dsn, user=runtime),
           "stranger_dsn": make_conninfo(pg_dsn, user=stranger)}
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY(%s)",
                  ([owner, runtime, stranger],))
        for s in (schema, app_schema):
            c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(s)))
        c.execute(sql.SQL("REVOKE CREATE ON DATABASE postgres FROM {}").format(sql.Identifier(owner)))
        for role in (stranger, runtime, owner):
            c.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _install(r: dict[str, str]) -> None:
    migrate(r["owner_dsn"], r["schema"], RingSizes(4, 4, 4))
    with psycopg.connect(r["owner_dsn"], autocommit=True) as c:
        Storage(r["schema"]).runtime_grant(c, r["runtime"])


def _seq_last(pg_dsn: str, seq: str) -> int:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        row = c.execute(sql.SQL("SELECT last_value FROM {}").format(sql.SQL(seq))).fetchone()
    assert row is not None
    return int(row[0])


# -- item 6: the confused deputy in ring_prune -------------------------------------------


def test_ring_prune_never_moves_a_sequence_named_in_a_table(pg_dsn: str, roles) -> None:
    r = roles
    schema, st = r["schema"], Storage(r["schema"])
    _install(r)
    app_seq = f'"{r["app_schema"]}".orders_id_seq'
    with psycopg.connect(r["owner_dsn"], autocommit=True) as c:
        # the application's own sequence: the owner can reach it, the runtime role cannot
        c.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(r["app_schema"])))
        c.execute(f"CREATE SEQUENCE {app_seq}")
        c.execute(f"SELECT setval('{app_seq}', 100)")
        seq_oid = c.execute(f"SELECT '{app_seq}'::regclass::oid").fetchone()[0]  # type: ignore[index]

    with psycopg.connect(r["rt_dsn"], autocommit=True) as rt:
        use_raw_jsonb(rt)
        client = Client(r["rt_dsn"], schema)
        client.enqueue("k", {"n": 1}, queue="q")  # creates the lane (its sequences) as the owner
        client.close()
        [(lane,)] = rt.execute(render("SELECT lane_id FROM __SCHEMA__.queue_claim_heads", schema)).fetchall()
        # The runtime role cannot rewrite which sequence is a lane's cursor, nor forge lanes.
        # Nor which sequence a claim setval()s as the lane's receipt mark (0025: claims run as the caller).
        for stmt in ("UPDATE __SCHEMA__.queue_claim_heads SET claim_seq = %s::oid::regclass",
                     "UPDATE __SCHEMA__.queue_claim_heads SET receipt_seq = %s::oid::regclass",
                     "UPDATE __SCHEMA__.queue_enqueue_heads SET enqueue_seq = %s::oid::regclass"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                rt.execute(render(stmt, schema), (seq_oid,))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            rt.execute(render("INSERT INTO __SCHEMA__.queue_lanes (queue, priority, shard) VALUES ('x', 1, 0)",
                              schema))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            rt.execute(render("DELETE FROM __SCHEMA__.queue_claim_heads", schema))

    # Even when a claim head does point at the foreign sequence (written by someone who could,
    # say under an earlier grant), prune derives each lane's cursor from the schema and lane id.
    with psycopg.connect(pg_dsn, autocommit=True) as su:
        su.execute(render("UPDATE __SCHEMA__.queue_claim_heads SET claim_seq = %s::oid::regclass", schema),
                   (seq_oid,))
    forge = ("INSERT INTO __SCHEMA__.lease_claims (claim_slot, claim_id, lane_id, ready_slot, first_seq, last_seq,"
             " job_ids, run_leases, lane_seqs) VALUES (%s, %s, %s, 0, 1, %s, '{}', '{}', '{}')")
    with psycopg.connect(r["rt_dsn"], autocommit=True) as rt:
        # A forged receipt far past the cursor: the claim prune advances "the lane's cursor" to it.
        rt.execute(render(forge, schema), (0, 10**9, lane, 1_000_000))
        assert st.ring_rotate(rt, "claim") == 1
        st.ring_prune(rt, "claim", 0)
        assert _seq_last(pg_dsn, app_seq) == 100, "ring_prune (claim) moved the application's sequence"
        # the lane's real cursor moved instead: the advance itself still works
        assert _seq_last(pg_dsn, f'"{schema}".lane_{lane}_claim') == 1_000_000
        # The ready prune advances the cursors of the lanes in the slot, and its gate reads them.
        rt.execute(render(forge, schema), (1, 10**9 + 1, lane, 2_000_000))
        assert st.ring_rotate(rt, "ready") == 1
        st.ring_prune(rt, "ready", 0)
        assert _seq_last(pg_dsn, app_seq) == 100, "ring_prune (ready) moved the application's sequence"
        assert _seq_last(pg_dsn, f'"{schema}".lane_{lane}_claim') == 2_000_000
        # An unknown ring is refused, not pruned as the lease ring.
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            st.ring_prune(rt, "bogus", 2)


# -- item 7: EXECUTE only for granted roles; reserved schema names ----------------------------


def _functions(conn: psycopg.Connection, schema: str) -> list[tuple[int, str, str]]:
    """(oid, name, call with NULL arguments) of every function in ``schema``."""
    rows = conn.execute(
        "SELECT p.oid, p.proname, COALESCE((SELECT string_agg(format('NULL::%%s', format_type(t, NULL)), ', '"
        " ORDER BY i) FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS a(t, i)), '') "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s ORDER BY p.proname",
        (schema,)).fetchall()
    return [(int(oid), name, f'SELECT "{schema}".{name}({args})') for oid, name, args in rows]


def _assert_nobody_else_may_execute(pg_dsn: str, r: dict[str, str]) -> None:
    schema = r["schema"]
    with psycopg.connect(pg_dsn, autocommit=True) as su:
        # The stranger may see the schema (as a monitoring role would), but was granted nothing else.
        su.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema),
                                                                    sql.Identifier(r["stranger"])))
        funcs = _functions(su, schema)
        names = {name for _, name, _ in funcs}
        assert {"ring_prune", "lane_ensure", "claim_batch_v2", "runtime_grant", "lane_claim_seq"} <= names
        public = su.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace, aclexplode("
            "COALESCE(p.proacl, acldefault('f', p.proowner))) x WHERE n.nspname = %s AND x.grantee = 0",
            (schema,)).fetchall()
        assert public == [], f"executable by PUBLIC: {public}"
        for oid, name, _ in funcs:
            for role, expected in ((r["stranger"], False),
                                   (r["runtime"], name not in ("runtime_grant", "ring_install"))):
                row = su.execute("SELECT has_function_privilege(%s, %s::oid, 'EXECUTE')", (role, oid)).fetchone()
                assert row is not None and row[0] is expected, (role, name)
    with psycopg.connect(r["stranger_dsn"], autocommit=True) as c:
        for _, _name, call in funcs:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(call)


def test_no_function_is_executable_without_a_grant(pg_dsn: str, roles) -> None:
    _install(roles)
    _assert_nobody_else_may_execute(pg_dsn, roles)
    # Running migrate again (nothing to apply) keeps it so.
    migrate(roles["owner_dsn"], roles["schema"])
    _assert_nobody_else_may_execute(pg_dsn, roles)


def test_upgrade_regrants_roles_of_an_earlier_runtime_grant(pg_dsn: str, roles) -> None:
    """A schema at version 4 with a role granted then: migration 6 (and whatever follows) applies the new rules
    to it."""
    r = roles
    schema = r["schema"]
    with psycopg.connect(r["owner_dsn"], autocommit=True) as c:
        # what migrate() did up to version 4
        assert migrate_before(c, schema, migrations()[4].name) == 5
        c.execute(render("SELECT __SCHEMA__.runtime_grant(%s)", schema), (r["runtime"],))
    with psycopg.connect(r["rt_dsn"], autocommit=True) as rt:  # version 4: the runtime role could write
        rt.execute(render("UPDATE __SCHEMA__.queue_claim_heads SET claim_seq = claim_seq", schema))
        # a lane from before the upgrade: its receipt mark (0025) is created by the migration, as the owner
        rt.execute(render("SELECT __SCHEMA__.job_enqueue('q', 2, 'k', '{}'::jsonb, NULL, 5, NULL)", schema))
    result = migrate(r["owner_dsn"], schema)
    assert (result.from_version, result.to_version) == (4, latest_version())
    _assert_nobody_else_may_execute(pg_dsn, r)
    st = Storage(schema)
    with psycopg.connect(r["rt_dsn"], autocommit=True) as rt:
        use_raw_jsonb(rt)
        client = Client(r["rt_dsn"], schema)
        client.enqueue("k", {"n": 1}, queue="q")
        client.close()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            rt.execute(render("UPDATE __SCHEMA__.queue_claim_heads SET claim_seq = claim_seq", schema))
        # the claim's row lock still works, and so does its setval of the migrated lane's mark
        snaps = st.lane_claim(rt, "q", 10)
        assert len(snaps) == 2
        with rt.transaction():
            assert st.receipt_complete(rt, snaps) == []


@pytest.mark.parametrize("name", ["public", "information_schema", "pg_catalog", "pg_awa"])
def test_reserved_schema_names_are_refused_in_one_line(pg_dsn: str, name: str) -> None:
    with pytest.raises(InvalidName) as err:
        validate_schema(name)
    assert "\n" not in str(err.value) and "belong to PostgreSQL" in str(err.value)
    with pytest.raises(InvalidName):
        migrate("host=/nonexistent dbname=x", name)  # refused before any connection
    res = cli("migrate", "--schema", name, "--dsn", pg_dsn)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "belong to PostgreSQL" in res.stderr, res.stderr


def test_runtime_grant_refuses_public_and_predefined_roles(storage: Storage, conn: psycopg.Connection) -> None:
    for role in ("public", "PUBLIC", "pg_monitor", ""):
        with pytest.raises(ConfigError):
            storage.runtime_grant(conn, role)


# -- item 8: passwords -----------------------------------------------------------------


SECRET = "s3cret-Pw-" + uuid.uuid4().hex[:8]


def test_runtime_configs_do_not_print_the_dsn() -> None:
    dsn = f"postgresql://u:{SECRET}@db.example/app"
    configs = [
        ClaimerConfig(dsn, "s", "q"),
        BatcherConfig(dsn, "s"),
        HeartbeatConfig(dsn, "s"),
        MaintenanceConfig(dsn, "s"),
        SupervisorConfig("m:app", dsn, "s", (QueueSpec("q"),)),
    ]
    for cfg in configs:
        assert SECRET not in repr(cfg) and "db.example" not in repr(cfg), repr(cfg)
        assert cfg.dsn == dsn


@pytest.mark.parametrize("dsn", [
    f"postgresql://u:{SECRET}@[::1/db",             # libpq quotes the whole URI
    f"host=/tmp dbname=x password={SECRET} port",   # ... or the token after the password
    f"postgresql://u:{SECRET}%zz@h/db",             # ... or the bad percent-encoded password
    f"password={SECRET} bogus_option=1",
])
def test_malformed_dsn_error_does_not_show_the_password(dsn: str) -> None:
    with pytest.raises(ConfigError) as err:
        connect(dsn)
    assert SECRET not in str(err.value) and "invalid DSN" in str(err.value)
    client = Client(dsn, "awa_fast")
    with pytest.raises(ConfigError) as err:
        client.enqueue("k", {})
    assert SECRET not in str(err.value)


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def test_supervisor_and_children_do_not_show_the_password_in_ps(pg_dsn: str, schema: str,
                                                                 tmp_path: pathlib.Path) -> None:
    # the test server trusts local connections: the password is carried, never checked
    dsn = make_conninfo(pg_dsn, password=SECRET)
    with SupervisorProc(dsn, schema, tmp_path) as sup:
        sup.wait_running(2)
        kids = [p for p in sup.children() if pid_alive(p)]
        assert len(kids) == 3, kids  # two claimers and maintenance
        for pid in (sup.pid, *kids):
            shown = _cmdline(pid)
            assert SECRET.encode() not in shown, f"pid {pid} shows the password: {shown!r}"
            if shown.startswith(b"awa-fast: "):  # a process title (setproctitle installed) replaced the arguments
                continue
            assert b"supervise" in shown, shown
            assert b"password=***" in shown, shown
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
        assert SECRET not in ps
        assert sup.stop() == 0, sup.tail()


def test_functions_of_a_later_migration_are_not_executable_by_public(pg_dsn: str, monkeypatch) -> None:
    """The migrator revokes PUBLIC's EXECUTE after every run, whatever a future migration forgets."""
    import awa_fast.storage.migrate as mig
    from awa_fast.storage.schema import Migration

    body = ("-- compatible-with-previous: yes\n"
            "CREATE FUNCTION __SCHEMA__.later_fn() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;")
    later = (*migrations(), Migration(len(migrations()) + 1, "later", body))
    monkeypatch.setattr(mig, "migrations", lambda: later)
    monkeypatch.setattr(mig, "latest_version", lambda: later[-1].version)
    name = "t_" + uuid.uuid4().hex[:12]
    try:
        mig.migrate(pg_dsn, name, RingSizes(4, 4, 4))
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            rows = c.execute(
                "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace, aclexplode("
                "COALESCE(p.proacl, acldefault('f', p.proowner))) x WHERE n.nspname = %s AND x.grantee = 0",
                (name,)).fetchall()
            assert rows == []
            assert c.execute("SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                             "WHERE n.nspname = %s AND p.proname = 'later_fn'", (name,)).fetchone() == (1,)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
