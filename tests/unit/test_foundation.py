"""The foundation: implementations in use, SQL shipped in the package, migrations numbered."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg

import awa_fast
from awa_fast import _impl
from awa_fast.errors import InvalidName
from awa_fast.storage.schema import latest_version, migrations, named_queries, render, validate_schema


def test_psycopg_uses_its_c_implementation() -> None:
    assert psycopg.pq.__impl__ in ("c", "binary")


def test_awa_fast_reports_the_live_implementation() -> None:
    assert awa_fast.__impl__ == _impl.IMPL
    wanted = os.environ.get("AWA_FAST_IMPL")
    if wanted:
        assert awa_fast.__impl__ == wanted


def test_migrations_ship_inside_the_package_and_are_numbered() -> None:
    found = migrations()
    assert [m.version for m in found] == list(range(1, len(found) + 1))
    assert latest_version() == found[-1].version >= 2
    # found through importlib.resources, from any working directory
    out = subprocess.run([sys.executable, "-c", "from awa_fast.storage.schema import latest_version as v; print(v())"],
                         capture_output=True, text=True, cwd="/", check=True)
    assert int(out.stdout) == latest_version()


def test_every_named_query_renders_with_a_quoted_schema() -> None:
    queries = named_queries("some_schema")
    assert {"lane_claim", "receipt_guard", "ring_prune", "job_enqueue"} <= set(queries)
    for text in queries.values():
        assert "__SCHEMA__" not in text


def test_hostile_schema_names_are_refused_before_any_sql() -> None:
    for bad in ['x"; drop table y; --', "Upper", "1abc", "", "a" * 64, "white space", None, 3]:
        try:
            validate_schema(bad)
        except InvalidName as exc:
            assert "schema" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    assert render("SELECT 1 FROM __SCHEMA__.t", "ok_name") == 'SELECT 1 FROM "ok_name".t'
