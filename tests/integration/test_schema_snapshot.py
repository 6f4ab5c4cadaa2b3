"""The migrations add up to ``sql/schema.sql``, exactly.

Every migration in ``sql/`` is applied in order to a scratch schema and the
result is dumped by ``tools/schema_dump.py``, the tool that writes the
snapshot. An edited migration, a new one without a regenerated snapshot, or
a hand-edited snapshot all fail here (procrastinate's ``tests/migration``
does the same with ``schema.sql``). To fix: ``.venv/bin/python tools/schema_dump.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from types import ModuleType

import pytest

import awa_fast.storage.migrate as migrate_module
from awa_fast.storage.schema import migrations

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("schema_dump", ROOT / "tools" / "schema_dump.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


schema_dump = _load_tool()


def test_all_migrations_give_exactly_the_snapshot(pg_dsn: str) -> None:
    expected = schema_dump.SNAPSHOT.read_text("utf-8")
    got = schema_dump.dump_migrations(pg_dsn)
    assert got == expected, (
        "sql/schema.sql is not what the migrations give; regenerate it with "
        "`.venv/bin/python tools/schema_dump.py` in the same commit as the migration:\n"
        + schema_dump.diff(expected, got)
    )


def test_an_edited_migration_no_longer_matches_the_snapshot(pg_dsn: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Editing a landed migration's function body changes the dump, so the test above fails."""
    migs = migrations()
    # the last migration that states lane_reserve's body (a later restatement would hide an edit)
    target = [m for m in migs if "IF v_before - v_claimed >= 64 THEN" in m.text][-1]
    assert target.text.count("IF v_before - v_claimed >= 64 THEN") == 1
    edited = dataclasses.replace(target, text=target.text.replace(
        "IF v_before - v_claimed >= 64 THEN", "IF v_before - v_claimed >= 65 THEN"))
    monkeypatch.setattr(migrate_module, "migrations",
                        lambda: tuple(edited if m is target else m for m in migs))
    got = schema_dump.dump_migrations(pg_dsn)
    expected = schema_dump.SNAPSHOT.read_text("utf-8")
    assert got != expected
    changed = [line for line in schema_dump.diff(expected, got).splitlines()
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == ["-    IF v_before - v_claimed >= 64 THEN", "+    IF v_before - v_claimed >= 65 THEN"]


def test_check_mode_exits_1_with_a_diff_for_a_stale_snapshot(pg_dsn: str, tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "schema.sql"
    good.write_text(schema_dump.SNAPSHOT.read_text("utf-8"), "utf-8")
    assert schema_dump.main(["--dsn", pg_dsn, "--check", "--output", str(good)]) == 0

    stale = tmp_path / "stale.sql"
    stale.write_text(good.read_text("utf-8").replace("SECURITY DEFINER", "SECURITY INVOKER", 1), "utf-8")
    capsys.readouterr()
    assert schema_dump.main(["--dsn", pg_dsn, "--check", "--output", str(stale)]) == 1
    out = capsys.readouterr().out
    assert "--- sql/schema.sql (on disk)" in out
    assert "- SECURITY INVOKER" in out and "+ SECURITY DEFINER" in out
    assert stale.read_text("utf-8") != good.read_text("utf-8")  # --check never writes


def test_the_dump_is_deterministic(pg_dsn: str) -> None:
    assert schema_dump.dump_migrations(pg_dsn) == schema_dump.dump_migrations(pg_dsn)
