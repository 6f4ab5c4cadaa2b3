"""Only the storage layer runs SQL: no module under awa_fast/ outside awa_fast/storage/ executes statements.

The check reads the source (no import): any call of a method named
``execute``, ``executemany``, ``copy`` or ``cursor``, on any object, outside
``awa_fast/storage/`` is a violation. The one exception is ``x.copy()``
with no argument (a dict or list copy: psycopg's ``Cursor.copy`` always
takes the statement). A violation is fixed by giving the query a name in
the storage layer (``awa_fast/sql/queries.sql`` and a ``Storage`` method, or
``awa_fast/storage/probes.py`` for measurement reads) and calling that.
"""

from __future__ import annotations

import ast
import pathlib

import awa_fast

PACKAGE = pathlib.Path(awa_fast.__file__).resolve().parent
STORAGE = PACKAGE / "storage"
SQL_METHODS = frozenset({"execute", "executemany", "copy", "cursor"})


def sql_calls(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, description) of every call that runs SQL in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        if name not in SQL_METHODS:
            continue
        if name == "copy" and not node.args and not node.keywords:
            continue  # dict.copy() / list.copy()
        found.append((node.lineno, f"{ast.unparse(node.func.value)}.{name}(...)"))
    return found


def modules_outside_storage() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if STORAGE not in p.parents)


def test_the_check_sees_each_kind_of_sql_call() -> None:
    source = ("conn.execute('SELECT 1')\n"
              "cur.executemany('INSERT', rows)\n"
              "with cur.copy('COPY t FROM STDIN') as cp: pass\n"
              "self._conn.cursor().fetchone()\n"
              "env = os.environ.copy()\n")
    assert [line for line, _ in sql_calls(source)] == [1, 2, 3, 4]


def test_no_module_outside_storage_runs_sql() -> None:
    modules = modules_outside_storage()
    assert len(modules) > 10 and PACKAGE / "app.py" in modules  # the walk finds the package
    violations = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
                  for path in modules for line, what in sql_calls(path.read_text(encoding="utf-8"), str(path))]
    assert not violations, (
        "SQL outside awa_fast/storage/ (only the storage layer runs SQL; give each query a name there "
        "and call it):\n  " + "\n  ".join(violations))
