"""Process titles (awa_fast/proctitle.py): a real supervisor and its children, read from /proc/PID/cmdline."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import urllib.request

import pytest
from psycopg.conninfo import make_conninfo

from awa_fast import proctitle
from tests.fixtures.supervisor import SupervisorProc
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.integration

SECRET = "pw-in-the-title-never-7c1e"


def _serves(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback
            return resp.status == 200
    except OSError:
        return False


def _shown(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_supervisor_claimers_and_maintenance_have_readable_titles_without_the_dsn(pg_dsn, schema, tmp_path):
    assert proctitle.available(), "setproctitle is part of the proctitle extra that tools/dev.py installs"
    dsn = make_conninfo(pg_dsn, password=SECRET)  # the test server trusts local connections
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SupervisorProc(dsn, schema, tmp_path, app="tests.integration.logs_apps:app",
                        queues=["logq:stripes=2,concurrency=2", "other:stripes=1"],
                        extra=["--metrics", f"127.0.0.1:{port}"]) as sup:
        claimers = sup.wait_running(3)

        def settled() -> dict[int, str] | None:  # every child forked and past setting its title
            seen = {pid: _shown(pid) for pid in sup.children()}
            done = len(seen) == 5 and not any(t.startswith("awa-fast: supervisor") for t in seen.values())
            return seen if done else None
        titles = wait_for(settled, 30, "five titled children", on_timeout=sup.tail)
        assert _shown(sup.pid) == "awa-fast: supervisor tests.integration.logs_apps:app"
        assert titles[claimers[("logq", 0)]] == "awa-fast: claimer queue=logq stripe=0"
        assert titles[claimers[("logq", 1)]] == "awa-fast: claimer queue=logq stripe=1"
        assert titles[claimers[("other", 0)]] == "awa-fast: claimer queue=other stripe=0"
        assert sorted(titles.values()).count("awa-fast: metrics") == 1, titles
        maintenance = [pid for pid, t in titles.items() if t.startswith("awa-fast: maintenance")]
        assert len(maintenance) == 1, titles
        wait_for(lambda: _shown(maintenance[0]) == "awa-fast: maintenance (leader)", 30, "the leader's title",
                 on_timeout=lambda: f"{_shown(maintenance[0])!r}\n{sup.tail()}")
        # stop only once the metrics child serves: a SIGTERM that reaches it before it installed its own
        # handler is taken by the supervisor's inherited one, and the child then waits for the drain timeout
        wait_for(lambda: _serves(f"http://127.0.0.1:{port}/healthz"), 30, "metrics serving", on_timeout=sup.tail)
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
        assert SECRET not in ps and SECRET not in "".join(titles.values())
        assert sup.stop() == 0, sup.tail()


def test_child_title_names_queue_and_stripe():
    assert proctitle.child_title("claimer my.queue:v2#3") == "claimer queue=my.queue:v2 stripe=3"
    assert proctitle.child_title("maintenance") == "maintenance"


def test_an_in_process_worker_keeps_the_process_title(pg_dsn, schema):
    from awa_fast.app import App

    before = _shown_self()
    app = App(pg_dsn, schema)

    @app.job("k", queue="inproc")
    def k(job):  # noqa: ANN001, ANN202
        return None

    app.enqueue("k", {})
    summary = app.run_worker(["inproc"], until_empty=True, install_signal_handlers=False)
    assert summary.completed == 1
    assert _shown_self() == before  # maintenance ran and led in a thread: the title is the user's
    app.close()


def _shown_self() -> str:
    return pathlib.Path("/proc/self/cmdline").read_bytes().decode(errors="replace")
