"""Apply the numbered migrations in one transaction under an advisory lock."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

from awa_fast.errors import ConfigError, SchemaTooNew
from awa_fast.storage.compat import record as record_compat
from awa_fast.storage.schema import latest_version, migrations, render, validate_schema

log = logging.getLogger("awa_fast.migrate")

# Migration that creates ring_install(); rings are installed right after it.
_RING_INSTALL_AFTER = 2

# Re-asserted after every migration run, so functions of any later migration are covered too.
_REVOKE_PUBLIC = "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA __SCHEMA__ FROM PUBLIC"
# Roles an earlier runtime_grant() covered: they hold EXECUTE on some awa-fast
# function. A migration's new functions are executable by nobody but the owner
# (PUBLIC's default is revoked), so the migrator grants these roles again:
# an upgrade never locks a running application's runtime role out.
_RUNTIME_ROLES = """
SELECT DISTINCT a.rolname
FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
CROSS JOIN LATERAL aclexplode(p.proacl) x
JOIN pg_roles a ON a.oid = x.grantee
WHERE n.nspname = %s AND x.privilege_type = 'EXECUTE' AND x.grantee <> p.proowner
ORDER BY 1
"""


@dataclass(frozen=True, slots=True)
class RingSizes:
    """Slot counts per ring, fixed when the schema is installed."""

    ready: int = 16
    claim: int = 8
    lease: int = 8

    def __post_init__(self) -> None:
        for ring in ("ready", "claim", "lease"):
            value = getattr(self, ring)
            if not isinstance(value, int) or not 4 <= value <= 64:
                raise ConfigError(f"{ring} ring slots={value!r}: use 4..64")


@dataclass(frozen=True, slots=True)
class MigrateResult:
    """What a migrate call found and did."""

    schema: str
    from_version: int
    to_version: int

    @property
    def changed(self) -> bool:
        return self.from_version != self.to_version


def schema_version(conn: psycopg.Connection, schema: str) -> int:
    """Installed version of ``schema`` (0 when not installed)."""
    validate_schema(schema)
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".schema_migrations',)
    ).fetchone()
    if not row or not row[0]:
        return 0
    row = conn.execute(render("SELECT max(version) FROM __SCHEMA__.schema_migrations", schema)).fetchone()
    return int(row[0] or 0) if row else 0


def migrate(dsn_or_conn: str | psycopg.Connection, schema: str = "awa_fast",
            rings: RingSizes | None = None) -> MigrateResult:
    """Bring ``schema`` up to this package's version; idempotent and concurrency-safe.

    Runs every pending migration in one transaction holding a transaction
    advisory lock, so two concurrent calls apply each migration once. A
    schema newer than the package raises :class:`SchemaTooNew` and changes
    nothing.
    """
    validate_schema(schema)
    rings = rings or RingSizes()
    own = isinstance(dsn_or_conn, str)
    conn = psycopg.connect(dsn_or_conn, autocommit=True) if isinstance(dsn_or_conn, str) else dsn_or_conn
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('awa_fast:migrate'), hashtext(%s))", (schema,))
            conn.execute(render("CREATE SCHEMA IF NOT EXISTS __SCHEMA__", schema))
            conn.execute(render(
                "CREATE TABLE IF NOT EXISTS __SCHEMA__.schema_migrations ("
                " version int PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())", schema))
            found = schema_version(conn, schema)
            latest = latest_version()
            if found > latest:
                raise SchemaTooNew(schema, latest, found)
            for mig in migrations():
                if mig.version <= found:
                    continue
                conn.execute(render(mig.text, schema))
                conn.execute(render(
                    "INSERT INTO __SCHEMA__.schema_migrations (version, name) VALUES (%s, %s)", schema),
                    (mig.version, mig.name))
                if mig.version == _RING_INSTALL_AFTER:
                    conn.execute(render("SELECT __SCHEMA__.ring_install(%s, %s, %s)", schema),
                                 (rings.ready, rings.claim, rings.lease))
                log.info("applied migration %04d_%s to %s", mig.version, mig.name, schema,
                         extra={"action": "migrate"})
            if latest > found:
                # A function is executable by PUBLIC when created, and some run as the owner
                # (SECURITY DEFINER): only the roles runtime_grant() names may execute any.
                conn.execute(render(_REVOKE_PUBLIC, schema))
                for (role,) in conn.execute(_RUNTIME_ROLES, (schema,)).fetchall():
                    conn.execute(render("SELECT __SCHEMA__.runtime_grant(%s)", schema), (role,))
            record_compat(conn, schema, migrations(), latest)  # rolling upgrades (awa_fast.storage.compat)
        return MigrateResult(schema, found, latest)
    finally:
        if own:
            conn.close()
