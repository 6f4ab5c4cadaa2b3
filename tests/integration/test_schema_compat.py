"""Rolling upgrades: a runtime keeps running against a newer schema that declares itself compatible.

A "next release" is simulated by a synthetic migration N+1 applied with the
migrator; the runtime under test is this package, which knows only up to N
(the previous release's runtime, as far as the schema is concerned).
"""

from __future__ import annotations

import pytest

from awa_fast.errors import SchemaTooNew
from awa_fast.storage import compat
from awa_fast.storage import migrate as migrate_mod
from awa_fast.storage.migrate import migrate, schema_version
from awa_fast.storage.schema import Migration, latest_version, migrations
from tests.fixtures.database import sqlx_all
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import QUEUE, counts, enqueue_bulk

_ADDITIVE = """-- synthetic next release: a new table and a column with a default
-- compatible-with-previous: {flag}
CREATE TABLE __SCHEMA__.synthetic_feature (id bigint PRIMARY KEY, note text);
ALTER TABLE __SCHEMA__.queue_meta ADD COLUMN synthetic_flag boolean NOT NULL DEFAULT false;
"""


def _apply_next(monkeypatch: pytest.MonkeyPatch, dsn: str, schema: str, flag: str) -> int:
    """Migrate with a package that ships one more migration; then restore this package's view."""
    nxt = latest_version() + 1
    shipped = (*migrations(), Migration(nxt, "synthetic_next", _ADDITIVE.format(flag=flag)))
    with monkeypatch.context() as m:
        m.setattr(migrate_mod, "migrations", lambda: shipped)
        m.setattr(migrate_mod, "latest_version", lambda: nxt)
        result = migrate(dsn, schema)
    assert (result.from_version, result.to_version) == (nxt - 1, nxt)
    return nxt


def test_every_shipped_migration_from_5_declares_its_compatibility():
    found = compat.flags(migrations())
    assert set(found) == set(range(compat.FIRST_DECLARED, latest_version() + 1))
    bad = Migration(99, "undeclared", "CREATE TABLE x (id int);")
    with pytest.raises(ValueError, match="no '-- compatible-with-previous: yes|no' header"):
        compat.flags([bad])
    late = Migration(98, "late", "-- header\nCREATE TABLE x (id int);\n-- compatible-with-previous: yes\n")
    assert compat.declared(late) is None  # only the leading comment block counts


def test_the_migrator_records_each_flag(pg_dsn, schema, conn):
    rows = sqlx_all(conn, schema, "SELECT version, compatible_with_previous FROM __SCHEMA__.schema_compat ORDER BY 1")
    assert rows == sorted(compat.flags(migrations()).items())


def test_previous_runtime_keeps_draining_after_an_additive_compatible_migration(
        pg_dsn, schema, storage, conn, tmp_path, monkeypatch):
    with SupervisorProc(pg_dsn, schema, tmp_path, queues=[f"{QUEUE}:stripes=1,concurrency=8"]) as sup:
        sup.wait_running(1)
        enqueue_bulk(pg_dsn, schema, "rt.sync", ({"i": i} for i in range(200)))
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 200, 60, "the first 200",
                 on_timeout=sup.tail)
        nxt = _apply_next(monkeypatch, pg_dsn, schema, "yes")
        assert schema_version(conn, schema) == nxt > latest_version()
        storage.schema_check(conn)  # accepted: the one newer migration is declared compatible
        # the running supervisor keeps claiming and completing on the newer schema ...
        enqueue_bulk(pg_dsn, schema, "rt.sync", ({"i": i} for i in range(200)))
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 400, 60, "200 more", on_timeout=sup.tail)
        assert sup.stop(60) == 0, sup.tail()
    # ... and so does one (re)started after the migration, where it used to exit 2 with SchemaTooNew.
    with SupervisorProc(pg_dsn, schema, tmp_path, name="restarted",
                        queues=[f"{QUEUE}:stripes=1,concurrency=8"]) as sup:
        sup.wait_running(1)
        enqueue_bulk(pg_dsn, schema, "rt.sync", ({"i": i} for i in range(200)))
        wait_for(lambda: counts(storage, conn).get("completed", 0) == 600, 60, "200 after a restart",
                 on_timeout=sup.tail)
        assert sup.stop(60) == 0, sup.tail()
        assert "declared compatible" in sup.output()
    assert counts(storage, conn) == {"completed": 600}


def test_a_migration_declared_incompatible_is_refused_with_schema_too_new(pg_dsn, schema, storage, conn, tmp_path,
                                                                         monkeypatch):
    nxt = _apply_next(monkeypatch, pg_dsn, schema, "no")
    with pytest.raises(SchemaTooNew) as err:
        storage.schema_check(conn)
    assert (err.value.package, err.value.found) == (latest_version(), nxt)
    with SupervisorProc(pg_dsn, schema, tmp_path, queues=[f"{QUEUE}:stripes=1"]) as sup:
        assert sup.wait(60) == 2
        assert "upgrade the awa-fast package" in sup.output()
