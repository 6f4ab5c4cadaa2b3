"""Schema names, the SQL template token, and the migrations shipped in the wheel.

The SQL files in ``awa_fast.sql`` use one template token, ``__SCHEMA__``,
replaced by the validated, double-quoted schema identifier. Nothing else is
ever formatted into SQL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from awa_fast.errors import InvalidName

SCHEMA_TOKEN = "__SCHEMA__"
_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_MIGRATION_RE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


_RESERVED_SCHEMAS = frozenset({"public", "information_schema"})


def validate_schema(name: object) -> str:
    """Return ``name`` if it is a valid awa-fast schema name, else raise :class:`InvalidName`.

    PostgreSQL's own schemas are refused: ``public`` (every role may use it,
    so the runtime grants would reach everyone), ``information_schema`` and
    ``pg_*``.
    """
    if not isinstance(name, str) or not _SCHEMA_RE.fullmatch(name):
        raise InvalidName(
            "schema",
            name,
            "use a lower-case SQL identifier: a letter or _, then letters, digits or _, at most 63",
        )
    if name in _RESERVED_SCHEMAS or name.startswith("pg_"):
        raise InvalidName(
            "schema",
            name,
            "'public', 'information_schema' and 'pg_*' belong to PostgreSQL; "
            "give awa-fast a schema of its own (default awa_fast)",
        )
    return name


def render(sql_text: str, schema: str) -> str:
    """Replace the schema token with the quoted identifier of a validated schema."""
    return sql_text.replace(SCHEMA_TOKEN, '"' + validate_schema(schema) + '"')


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered, immutable migration file."""

    version: int
    name: str
    text: str


@lru_cache(maxsize=1)
def sql_files() -> Traversable:
    """The package's SQL folder (``awa_fast.sql``), checked to belong to the same checkout or install.

    A wheel ships it inside the package (``awa_fast/sql``); a checkout keeps it next to the
    package (``sql/``, mapped by the build). An editable install maps ``awa_fast.sql`` to its
    own checkout whatever ``PYTHONPATH`` says, so another checkout's code put first on the path
    (a worktree to compare against) would run this checkout's migrations and queries. That mix
    is refused here, before any SQL is read or run.
    """
    import awa_fast

    files = resources.files("awa_fast.sql")
    package = Path(awa_fast.__file__).resolve().parent
    if isinstance(files, Path) and files.resolve() not in (package / "sql", package.parent / "sql"):
        raise ImportError(
            f"awa_fast's code comes from {package} but its SQL from {files}: another checkout is "
            f"first on the path beside an editable install. Link its SQL into it "
            f"(ln -s ../sql {package}/sql) or give it its own virtual environment.")
    return files


@lru_cache(maxsize=1)
def migrations() -> tuple[Migration, ...]:
    """All migrations shipped with the package, in version order."""
    found = []
    for entry in sql_files().iterdir():
        m = _MIGRATION_RE.fullmatch(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"awa_fast.sql migrations are not numbered 1..n: {versions}")
    return tuple(found)


def latest_version() -> int:
    """The schema version this package creates."""
    return migrations()[-1].version


@cache
def named_queries(schema: str) -> dict[str, str]:
    """Named queries from ``queries.sql`` (``-- name: noun_verb``), rendered for ``schema``."""
    text = sql_files().joinpath("queries.sql").read_text("utf-8")
    out: dict[str, str] = {}
    name = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("-- name:"):
            if name:
                out[name] = render("\n".join(lines).strip(), schema)
            name = line.split(":", 1)[1].strip()
            lines = []
        elif name is not None:
            lines.append(line)
    if name:
        out[name] = render("\n".join(lines).strip(), schema)
    return out
