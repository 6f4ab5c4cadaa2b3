"""Every Python code block of README.md runs as written against a private server.

Each block runs in a fresh interpreter from a directory outside the
checkout, with only ``AWA_FAST_DSN`` and ``AWA_FAST_SCHEMA`` pointing it at
the test's server and schema (the README's ``awa_fast.App()`` follows that
rule), so the README can never drift from the API again.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from awa_fast.storage import Storage
from tests.fixtures.database import connect

pytestmark = pytest.mark.integration

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[str]:
    return BLOCK.findall(README.read_text("utf-8"))


def test_the_readme_has_python_blocks():
    blocks = python_blocks()
    assert blocks and any("awa_fast.App(" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs_as_written(index, pg_dsn, schema, tmp_path):
    code = python_blocks()[index]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "AWA_FAST_HOME")}
    env.update(AWA_FAST_DSN=pg_dsn, AWA_FAST_SCHEMA=schema, AWA_FAST_HOME=str(tmp_path / "home"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"README block {index} failed:\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "home" / "pgdata").exists(), "the block started an embedded server"
    if index == 0:
        # what the Use section claims it printed and did
        out = res.stdout.splitlines()
        assert out[0] == "available 0 {'to': 'a@example.com', 'send_after': None}", out
        assert out[1:4] == ["True", "10000", "300.0"], out
        c = connect(pg_dsn, schema, tag="readme")
        try:
            counts = Storage(schema).queue_counts_exact(c)
        finally:
            c.close()
        assert counts["email"] == {"available": 1, "scheduled": 1}, counts  # the retried one is due now
        assert counts["media"] == {"available": 10_000, "cancelled": 1}, counts
    if index == 1:
        # periodic, unique, limits and the in-process worker, as the block's comments say
        assert res.stdout.splitlines() == ["already queued: True", "2 {'rows': 42}"], res.stdout
