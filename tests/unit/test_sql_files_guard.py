"""Another checkout's code first on the path must not run this checkout's SQL.

An editable install maps ``awa_fast.sql`` (the migrations and named queries) to its
own checkout whatever ``PYTHONPATH`` says. A second checkout put first on the path,
as an A/B against an older commit does, then imported its own Python with this
checkout's SQL: the two arms ran the same migrations. ``sql_files()`` refuses
that mix with an error that says how to fix it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from importlib import resources

import pytest

import awa_fast

PROBE = "from awa_fast.storage.schema import migrations; print(len(migrations()))"


def _run(pythonpath: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=pythonpath, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_second_checkout_on_the_path_is_refused_until_its_sql_is_its_own(tmp_path):
    package = pathlib.Path(awa_fast.__file__).resolve().parent
    sql = pathlib.Path(str(resources.files("awa_fast.sql"))).resolve()
    if sql.parent == package:
        pytest.skip("a wheel install ships awa_fast/sql inside the package: no checkout to mix with")
    other = tmp_path / "other"
    shutil.copytree(package, other / "awa_fast", ignore=shutil.ignore_patterns("__pycache__", "sql"))

    mixed = _run(other)
    assert mixed.returncode != 0
    assert f"code comes from {other / 'awa_fast'} but its SQL from {sql}" in mixed.stderr
    assert "ln -s ../sql" in mixed.stderr

    shutil.copytree(sql, other / "sql", ignore=shutil.ignore_patterns("__pycache__"))
    (other / "awa_fast" / "sql").symlink_to("../sql")
    own = _run(other)
    assert own.returncode == 0, own.stderr
    assert int(own.stdout) >= 34
