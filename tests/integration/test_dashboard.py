"""The web dashboard: access rules over HTTP, then every page in a real headless Chromium.

The browser test runs against a live ``awa-fast supervise`` with work
flowing, signs in with the admin token, cancels a job and retries a DLQ
entry through the UI, and checks what the pages show against the JSON API.
It is skipped (with the reason) only where no Chromium is installed;
``.ci/run`` installs Debian's ``chromium``.
"""

from __future__ import annotations

import json
import os
import pathlib
import urllib.error
import urllib.request
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the [web] extra is not installed")

import awa_fast  # noqa: E402
from tests.fixtures.database import connect  # noqa: E402
from tests.fixtures.supervisor import SupervisorProc  # noqa: E402
from tests.fixtures.waiting import wait_for  # noqa: E402
from tests.integration.dashboard_helpers import CHROMIUM, CHROMIUM_ARGS, DashboardServer  # noqa: E402
from tests.integration.runtime_helpers import QUEUE, enqueue_bulk, enqueue_one  # noqa: E402

SCREENSHOTS = pathlib.Path(os.environ.get("AWA_FAST_SCREENSHOTS_DIR", "")) if os.environ.get(
    "AWA_FAST_SCREENSHOTS_DIR") else None


def _http(method: str, url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None,
          ) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback test server
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _api(server: DashboardServer, path: str) -> Any:
    status, body = _http("GET", server.url + path)
    assert status == 200, body
    return json.loads(body)


@pytest.fixture
def app(pg_dsn: str, schema: str) -> awa_fast.App:
    a = awa_fast.App(dsn=pg_dsn, schema=schema)
    yield a
    a.close()


def test_actions_need_the_token_and_reads_never_show_the_password(app: awa_fast.App, pg_dsn: str, schema: str,
                                                                  tmp_path: pathlib.Path) -> None:
    job_id = enqueue_one(pg_dsn, schema, "rt.sync", {}, delay=3600)
    # libpq ignores a password under trust authentication, so it can ride along in the DSN
    secret_dsn = f"{pg_dsn} password=hunter2-secret"
    with DashboardServer(app, secret_dsn, tmp_path / "home", tmp_path / "token") as srv:
        url = f"{srv.url}/api/jobs/{job_id}/cancel"
        assert _http("POST", url)[0] == 401
        assert _http("POST", url, headers={"Authorization": "Bearer wrong-token-0123456789"})[0] == 401
        # a browser-style post with no session, and one from a foreign origin
        assert _http("POST", f"{srv.url}/jobs/{job_id}/cancel", data=b"csrf=x")[0] == 401
        assert _http("POST", url, headers={"Authorization": f"Bearer {srv.token}",
                                           "Origin": "http://evil.example"})[0] == 403
        assert app.get_job(job_id).state == "scheduled"
        status, body = _http("POST", url, headers={"Authorization": f"Bearer {srv.token}"})
        assert status == 200 and json.loads(body)["cancelled"] is True
        assert app.get_job(job_id).state == "cancelled"
        for path in ("/", "/queues", "/jobs", f"/jobs/{job_id}", "/dlq", "/runtime", "/storage", "/login",
                     "/api/overview", "/api/queues", "/api/jobs", "/api/runtime", "/api/storage"):
            status, body = _http("GET", srv.url + path)
            assert status == 200, (path, body)
            assert "hunter2" not in body, path
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600


def test_read_only_hides_and_refuses_every_action(app: awa_fast.App, pg_dsn: str, schema: str,
                                                  tmp_path: pathlib.Path) -> None:
    job_id = enqueue_one(pg_dsn, schema, "rt.sync", {}, delay=3600)
    with DashboardServer(app, pg_dsn, None, tmp_path / "token", read_only=True) as srv:
        auth = {"Authorization": f"Bearer {srv.token}"}
        for path in (f"/api/jobs/{job_id}/cancel", f"/api/jobs/{job_id}/retry", "/api/dlq/retry",
                     "/api/dlq/purge", f"/api/queues/{QUEUE}/pause"):
            status, body = _http("POST", srv.url + path, data=b"", headers=auth)
            assert status == 403 and "read-only" in body, path
        status, page = _http("GET", f"{srv.url}/jobs/{job_id}")
        assert status == 200 and 'id="cancel"' not in page and 'id="read-only"' in page
    assert app.get_job(job_id).state == "scheduled"


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_every_page_in_a_real_browser(app: awa_fast.App, pg_dsn: str, schema: str, tmp_path: pathlib.Path) -> None:
    from playwright.sync_api import sync_playwright

    home = tmp_path / "home"
    with SupervisorProc(pg_dsn, schema, tmp_path, home=home) as sup, \
            DashboardServer(app, pg_dsn, home, tmp_path / "token") as srv, \
            connect(pg_dsn, schema) as conn:
        sup.wait_running()
        # work flowing: a backlog of short jobs, two that dead-letter, one scheduled to cancel
        enqueue_bulk(pg_dsn, schema, "rt.sleep", [{"ms": 2}] * 400)
        dead = [enqueue_one(pg_dsn, schema, "rt.fail", {}, max_attempts=1) for _ in range(2)]
        later = enqueue_one(pg_dsn, schema, "rt.sync", {}, delay=3600)
        wait_for(lambda: len(app.dlq_list(queue=QUEUE, conn=conn)) == 2, 60, "two DLQ entries")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            shots = SCREENSHOTS or tmp_path / "screenshots"
            shots.mkdir(parents=True, exist_ok=True)

            def visit(path: str, name: str) -> None:
                resp = page.goto(srv.url + path)
                assert resp is not None and resp.status == 200, path
                page.screenshot(path=str(shots / f"{name}.png"), full_page=True)

            # overview: the live chart script draws the sampled series once it has polled the API
            wait_for(lambda: sum(p["completed_per_s"] is not None for p in srv.backend.series) >= 3, 30,
                     "three chart samples")
            page.goto(srv.url + "/")
            # polled from Python: the page's CSP forbids the eval a string wait_for_function needs
            line = page.locator("#chart-throughput polyline")
            line.wait_for(state="attached")
            wait_for(lambda: len((line.get_attribute("points") or "").split()) >= 3, 30,
                     "the throughput chart's three points")
            page.screenshot(path=str(shots / "overview.png"), full_page=True)
            row = page.locator(f'#overview-queues tr[data-queue="{QUEUE}"]')
            assert row.count() == 1
            api_q = next(q for q in _api(srv, "/api/overview")["queues"] if q["queue"] == QUEUE)
            assert int(row.locator('[data-field="dlq"]').inner_text()) == api_q["dlq"] == 2
            # queues: the available count is the lane-head depth the API reports
            visit("/queues", "queues")
            assert page.locator(f'#queues tr[data-queue="{QUEUE}"]').count() == 1
            # jobs: a filter whose answer cannot move (the DLQ'd jobs) shows exactly the API's rows
            visit(f"/jobs?queue={QUEUE}&state=dlq", "jobs")
            shown = sorted(int(x) for x in page.locator("#jobs tr[data-job-id]").evaluate_all(
                "rows => rows.map(r => r.dataset.jobId)"))
            api_rows = sorted(j["job_id"] for j in _api(srv, f"/api/jobs?queue={QUEUE}&state=dlq"))
            assert shown == api_rows == sorted(dead)
            # runtime: one row per running claimer of the local supervisor
            visit("/runtime", "runtime")
            assert page.locator("table.claimers tr[data-claimer]").count() == len(sup.claimer_pids())
            # storage: the current slot of each ring is the API's
            visit("/storage", "storage")
            rings = _api(srv, "/api/storage")["rings"]
            for ring, st in rings.items():
                cell = page.locator(f'#rings tr[data-ring="{ring}"] [data-field="slot"]').inner_text()
                assert int(cell) == st["slot"], ring

            # sign in, then cancel the scheduled job through the UI
            page.goto(srv.url + "/login")
            page.fill("#token", srv.token)
            page.click("#sign-in-submit")
            page.wait_for_selector("#msg")
            visit(f"/jobs/{later}", "job")
            page.click("#cancel")
            page.wait_for_selector("#msg")
            assert page.locator('[data-field="state"]').inner_text() == "cancelled"
            assert app.get_job(later).state == "cancelled"

            # retry one DLQ entry through the UI: it leaves the DLQ and is ready to run again (the queue
            # is paused meanwhile, or rt.fail would send it straight back)
            assert app.pause(QUEUE, conn=conn)
            visit(f"/dlq?queue={QUEUE}", "dlq")
            page.locator(f'#dlq tr[data-job-id="{dead[0]}"] button.dlq-retry').click()
            page.wait_for_selector("#msg")
            assert page.locator(f'#dlq tr[data-job-id="{dead[0]}"]').count() == 0
            assert dead[0] not in [e.job_id for e in app.dlq_list(queue=QUEUE, conn=conn)]
            assert app.get_job(dead[0]).state == "available"
            assert app.resume(QUEUE, conn=conn)
            # purge asks first, and only the confirmed click deletes
            page.locator(f'#dlq tr[data-job-id="{dead[1]}"] button.dlq-purge').click()
            page.wait_for_selector("#confirm-purge")
            assert dead[1] in [e.job_id for e in app.dlq_list(queue=QUEUE, conn=conn)]
            page.click("#confirm-purge")
            page.wait_for_selector("#msg")
            assert dead[1] not in [e.job_id for e in app.dlq_list(queue=QUEUE, conn=conn)]
            browser.close()
        assert sup.stop() == 0


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_periodic_page_in_a_real_browser(app: awa_fast.App, pg_dsn: str, schema: str,
                                         tmp_path: pathlib.Path) -> None:
    from playwright.sync_api import sync_playwright

    from awa_fast import periodic
    from awa_fast.storage import Storage

    storage = Storage(schema)
    app.periodic("nightly-report", "30 2 * * *", "report.build", {"full": True}, timezone="Europe/Berlin",
                 queue="reports")
    app.periodic("every-second", "* * * * * *", "tick", queue="reports")
    with connect(pg_dsn, schema) as conn:
        periodic.sync_schedules(conn, storage, app)

        def fired() -> bool:
            periodic.evaluate_due(storage, conn)
            return any(r["last_tick"] is not None for r in storage.schedule_list(conn)[1])
        wait_for(fired, 30, "a first fire of every-second")

        with DashboardServer(app, pg_dsn, None, tmp_path / "token") as srv:
            api = {s["name"]: s for s in _api(srv, "/api/periodic")}
            assert set(api) == {r["name"] for r in storage.schedule_list(conn)[1]} == {"nightly-report",
                                                                                       "every-second"}
            assert api["nightly-report"]["timezone"] == "Europe/Berlin" and api["nightly-report"]["next_fire"]
            assert api["every-second"]["last_fire"] is not None
            # without the token: refused, nothing changes
            assert _http("POST", f"{srv.url}/api/periodic/nightly-report/pause")[0] == 401
            assert _http("POST", f"{srv.url}/periodic/nightly-report/pause", data=b"csrf=x")[0] == 401
            assert _http("POST", f"{srv.url}/api/periodic/nightly-report/explode",
                         headers={"Authorization": f"Bearer {srv.token}"})[0] == 404
            assert not _api(srv, "/api/periodic")[0]["paused"]
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 600})
                page.goto(srv.url + "/login")
                page.fill("#token", srv.token)
                page.click("#sign-in-submit")
                page.wait_for_selector("#msg")
                page.goto(srv.url + "/periodic")
                rows = page.locator("#schedules tr[data-schedule]")
                assert sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.schedule)")) == sorted(api)
                night = page.locator('#schedules tr[data-schedule="nightly-report"]')

                def field(name: str) -> str:
                    return night.locator(f'[data-field="{name}"]').inner_text().strip()
                assert (field("cron"), field("timezone"), field("paused")) == ("30 2 * * *", "Europe/Berlin", "no")
                assert field("next_fire") == api["nightly-report"]["next_fire"]
                assert field("last_fire") == "—"
                every = page.locator('#schedules tr[data-schedule="every-second"] [data-field="last_fire"]')
                assert every.inner_text().strip() != "—"
                shots = SCREENSHOTS or tmp_path / "screenshots"
                shots.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(shots / "periodic.png"), full_page=True)
                # pause through the UI: the database says paused, the row too, and no next fire
                night.locator("button.schedule-pause").click()
                page.wait_for_selector("#msg")
                assert page.locator("#msg").inner_text() == "schedule nightly-report paused"
                assert (field("paused"), field("next_fire")) == ("yes", "—")
                paused = {r["name"]: r["paused"] for r in storage.schedule_list(conn)[1]}
                assert paused == {"nightly-report": True, "every-second": False}
                # trigger enqueues one job now; resume brings the next fire back
                night.locator("button.schedule-trigger").click()
                page.wait_for_selector("#msg")
                msg = page.locator("#msg").inner_text()
                assert msg.startswith("schedule nightly-report: enqueued job "), msg
                job = app.get_job(int(msg.rsplit(" ", 1)[1]))
                assert job is not None and job.kind == "report.build" and job.queue == "reports"
                night.locator("button.schedule-resume").click()
                page.wait_for_selector("#msg")
                assert field("paused") == "no" and field("next_fire") == api["nightly-report"]["next_fire"]
                browser.close()
        # read-only: no buttons, and the action refused even with the token
        with DashboardServer(app, pg_dsn, None, tmp_path / "token", read_only=True) as ro:
            status, body = _http("GET", ro.url + "/periodic")
            assert status == 200 and "nightly-report" in body and "schedule-pause" not in body
            status, body = _http("POST", f"{ro.url}/api/periodic/nightly-report/pause",
                                 headers={"Authorization": f"Bearer {ro.token}"})
            assert status == 403 and "read-only" in body
            assert not any(r["paused"] for r in storage.schedule_list(conn)[1])
