"""Running ``awa-fast bench`` in-process for the smoke tests."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from awa_fast.cli import main


def run_bench(capsys: pytest.CaptureFixture[str], pg_dsn: str, scenario: str, *args: str) -> dict[str, Any]:
    """``awa-fast bench SCENARIO --json ARGS`` on a fresh ``bench_t_*`` schema; returns its JSON object."""
    schema = "bench_t_" + uuid.uuid4().hex[:10]
    code = main(["--log-level", "WARNING", "bench", scenario, "--dsn", pg_dsn, "--schema", schema, "--json", *args])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    data = json.loads(out[-1])
    assert data["scenario"] == scenario
    return data
