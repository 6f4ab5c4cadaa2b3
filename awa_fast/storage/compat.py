"""Schema compatibility for rolling upgrades.

Every migration from ``0005`` on declares in its header whether the
previous release's runtime may keep running against the schema it
produces::

    -- compatible-with-previous: yes

The migrator records each applied migration's flag in
``schema_compat`` (:func:`record`), because an older runtime does not ship
the newer migration files. A runtime whose package knows versions up to
``M`` accepts a schema at version ``F > M`` when every migration
``M+1 .. F`` is recorded as compatible (:func:`check_newer`); otherwise it
refuses with :class:`SchemaTooNew` and changes nothing. See docs/deploy.md
for the upgrade order.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import psycopg

from awa_fast.errors import SchemaTooNew
from awa_fast.storage.schema import Migration, named_queries

log = logging.getLogger("awa_fast.compat")

# The first migration that must declare its compatibility (and the one that creates the ledger).
FIRST_DECLARED = 5
_HEADER_RE = re.compile(r"^--\s*compatible-with-previous:\s*(yes|no)\s*$", re.MULTILINE)


def declared(mig: Migration) -> bool | None:
    """The migration's ``-- compatible-with-previous: yes|no`` flag; None when it declares none.

    Only the leading comment block counts: the line must come before the
    first statement.
    """
    header = []
    for line in mig.text.splitlines():
        if line.strip() and not line.lstrip().startswith("--"):
            break
        header.append(line)
    found = _HEADER_RE.findall("\n".join(header))
    if len(found) > 1:
        raise ValueError(f"migration {mig.version:04d}_{mig.name} declares compatible-with-previous twice")
    return found[0] == "yes" if found else None


def flags(migs: Iterable[Migration]) -> dict[int, bool]:
    """Version -> flag of every migration from :data:`FIRST_DECLARED` on; raises if one declares none."""
    out: dict[int, bool] = {}
    for mig in migs:
        if mig.version < FIRST_DECLARED:
            continue
        flag = declared(mig)
        if flag is None:
            raise ValueError(f"migration {mig.version:04d}_{mig.name} has no '-- compatible-with-previous: yes|no' "
                             "header line: add one (yes only if the previous release's runtime keeps working)")
        out[mig.version] = flag
    return out


def record(conn: psycopg.Connection, schema: str, migs: Iterable[Migration], up_to: int) -> None:
    """Record the flags of the shipped migrations up to version ``up_to`` (in the migrator's transaction)."""
    known = {v: f for v, f in flags(migs).items() if v <= up_to}
    if not known:
        return
    versions = sorted(known)
    conn.execute(named_queries(schema)["schema_compat_record"], (versions, [known[v] for v in versions]))


def recorded(conn: psycopg.Connection, schema: str) -> dict[int, bool]:
    """The flags the database recorded (empty before migration 8, which creates the ledger)."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".schema_compat',)).fetchone()
    if not row or not row[0]:
        return {}
    return {int(v): bool(c) for v, c in conn.execute(named_queries(schema)["schema_compat_list"]).fetchall()}


def check_newer(conn: psycopg.Connection, schema: str, package: int, found: int) -> None:
    """Accept a schema at ``found`` newer than this package's ``package`` version, or raise SchemaTooNew.

    Accepted only when every migration ``package+1 .. found`` is recorded as
    compatible with its previous release.
    """
    have = recorded(conn, schema)
    blocking = [v for v in range(package + 1, found + 1) if not have.get(v, False)]
    if blocking:
        raise SchemaTooNew(schema, package, found)
    log.info("schema %s is at version %d, newer than this package (%d); every migration past %d is declared "
             "compatible with the previous release, so this runtime keeps running: upgrade it soon",
             schema, found, package, package, extra={"action": "schema_newer_compatible"})
