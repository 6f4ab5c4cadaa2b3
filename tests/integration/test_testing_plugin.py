"""The awa_fast.testing pytest plugin as users meet it: loaded by its entry point in a project of their own."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

APP_MODULE = '''
from awa_fast.app import App

app = App(None)

@app.job("greet", queue="hello")
def greet(job):
    return None
'''

TEST_MODULE = '''
from awa_fast.testing import assert_enqueued, drain

def test_greet(awa_app):
    awa_app.enqueue("greet", {"name": "ada"})
    assert_enqueued(awa_app, "greet", {"name": "ada"}, count=1)
    assert drain(awa_app).completed == 1
'''


def _project(root: pathlib.Path, ini: str, conftest: str = "") -> pathlib.Path:
    root.mkdir()
    (root / "pytest.ini").write_text(textwrap.dedent(ini))
    (root / "userapp.py").write_text(APP_MODULE)
    (root / "test_user.py").write_text(TEST_MODULE)
    if conftest:
        (root / "conftest.py").write_text(textwrap.dedent(conftest))
    return root


def _pytest(root: pathlib.Path, pg_dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH")}
    env.update(AWA_FAST_TEST_DSN=pg_dsn, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=str(root),
                          env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_the_app_named_by_the_ini_key_is_bound_per_test(pg_dsn, tmp_path):
    root = _project(tmp_path / "ini", "[pytest]\nawa_fast_app = userapp:app\n")
    res = _pytest(root, pg_dsn)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:]


def test_an_overridden_awa_fast_app_fixture_provides_the_app(pg_dsn, tmp_path):
    root = _project(tmp_path / "fixture", "[pytest]\n", """
        import pytest

        @pytest.fixture
        def awa_fast_app():
            from userapp import app
            return app
        """)
    res = _pytest(root, pg_dsn)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:]


def test_without_an_app_the_error_says_how_to_name_one_and_the_plugin_can_be_disabled(pg_dsn, tmp_path):
    root = _project(tmp_path / "none", "[pytest]\n")
    res = _pytest(root, pg_dsn)
    assert res.returncode != 0 and 'awa_fast_app = "package.module:app"' in res.stdout + res.stderr, res.stdout
    res = _pytest(root, pg_dsn, "-p", "no:awa_fast")
    assert res.returncode != 0 and "fixture 'awa_app' not found" in res.stdout, res.stdout[-3000:]
