"""Two supervisors of one schema on one host (issue 9 item 13): each keeps its own status locator.

Before, the second overwrote the first one's ``run/<schema>.json`` and the
first to exit removed it for both: ``status`` lost the survivor.
"""

from __future__ import annotations

import pytest

from awa_fast.runtime.shm import read_locators
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for
from tests.integration.runtime_helpers import QUEUE, cli, cli_json

pytestmark = pytest.mark.integration


def _status(pg_dsn: str, schema: str, home) -> dict:  # noqa: ANN001
    return cli_json("status", "--json", "--schema", schema, "--dsn", pg_dsn, "--home", str(home))


def _claimer_pids(snap: dict) -> set[int]:
    return {c["pid"] for c in snap["claimers"] if c["state"] == "running"}


def test_two_supervisors_each_keep_their_locator(pg_dsn, schema, tmp_path) -> None:
    home = tmp_path / "home"
    with SupervisorProc(pg_dsn, schema, tmp_path, home=home, name="first") as first:
        first_claimers = set(first.wait_running(2).values())
        with SupervisorProc(pg_dsn, schema, tmp_path, home=home, name="second") as second:
            second_claimers = set(second.wait_running(2).values())
            assert {pid for _, pid in read_locators(home, schema)} == {first.pid, second.pid}

            data = _status(pg_dsn, schema, home)
            by_pid = {s["supervisor_pid"]: s for s in data["supervisors"]}
            assert set(by_pid) == {first.pid, second.pid}
            assert _claimer_pids(by_pid[first.pid]) == first_claimers
            assert _claimer_pids(by_pid[second.pid]) == second_claimers
            assert data["local"]["supervisor_pid"] == first.pid  # the oldest
            text = cli("status", "--schema", schema, "--dsn", pg_dsn, "--home", str(home)).stdout
            assert f"supervisor pid {first.pid}:" in text and f"supervisor pid {second.pid}:" in text
            assert text.count(f"claimer {QUEUE}#") == 4

            # The first to exit removes its own locator only.
            assert first.stop() == 0, first.tail()
            data = wait_for(lambda: (d := _status(pg_dsn, schema, home))["supervisors"]
                            and len(d["supervisors"]) == 1 and d, 20, "one supervisor left")
            [left] = data["supervisors"]
            assert left["supervisor_pid"] == second.pid and data["local"]["supervisor_pid"] == second.pid
            assert _claimer_pids(left) == second_claimers
            assert [pid for _, pid in read_locators(home, schema)] == [second.pid]
            assert second.stop() == 0, second.tail()

    data = _status(pg_dsn, schema, home)
    assert data["supervisors"] == [] and data["local"] is None
    assert list((home / "run").glob(f"{schema}*.json")) == []


def test_a_killed_supervisors_locator_is_ignored_and_swept(pg_dsn, schema, tmp_path) -> None:
    home = tmp_path / "home"
    with SupervisorProc(pg_dsn, schema, tmp_path, home=home, name="killed") as killed:
        killed.wait_running(2)
        killed.kill_group()
        killed.wait(30)
    assert read_locators(home, schema) == []
    assert len(list((home / "run").glob(f"{schema}.*.json"))) == 1  # left behind by SIGKILL
    with SupervisorProc(pg_dsn, schema, tmp_path, home=home, name="next") as nxt:
        nxt.wait_running(2)
        assert [pid for _, pid in read_locators(home, schema)] == [nxt.pid]
        assert [p.name for p in (home / "run").glob(f"{schema}.*.json")] == [f"{schema}.{nxt.pid}.json"]
        assert nxt.stop() == 0, nxt.tail()
