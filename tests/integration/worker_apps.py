"""Apps for the in-process worker tests (tests/integration/test_worker.py).

Run as a script, it works one schema with ``app.run_worker`` on the main
thread (signal handlers installed) and prints the summary as JSON:
``python -m tests.integration.worker_apps DSN SCHEMA MARKER_DIR``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import threading

import awa_fast
from awa_fast.app import App


def build(dsn: str, schema: str, marker_dir: pathlib.Path | None = None,
          hold_seconds: float = 30.0) -> App:
    app = App(dsn, schema)
    release = threading.Event()

    @app.job("mixed", queue="w")
    def mixed(job):  # noqa: ANN001, ANN202
        i = job.args["i"]
        if i % 100 == 0:
            # retried, due in an hour (an exception's backoff, 16 s at least, could fall due under load)
            return awa_fast.RetryAfter(3600, f"later {i}")
        if i % 250 == 1:
            return awa_fast.Cancel("not needed")     # cancelled
        if i % 500 == 2:
            raise awa_fast.TerminalError("bad row")  # failed
        return None

    @app.job("mixed_async", queue="w")
    async def mixed_async(job):  # noqa: ANN001, ANN202
        return None

    @app.job("hold", queue="slow")
    def hold(job):  # noqa: ANN001, ANN202
        if marker_dir is not None:
            (marker_dir / f"started-{job.id}").write_text("1")
        release.wait(hold_seconds)

    app.release = release  # type: ignore[attr-defined]
    return app


def main(argv: list[str]) -> int:
    dsn, schema, marker = argv[1], argv[2], pathlib.Path(argv[3])
    app = build(dsn, schema, marker, hold_seconds=0.5)  # the SIGTERM lands while a job runs
    summary = app.run_worker({"slow": {"concurrency": 2}, "w": {}}, maintenance=True, drain_timeout=10)
    print(json.dumps(dataclasses.asdict(summary)), flush=True)
    app.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))


# For the deploy recipes (examples/deploy): `awa-fast supervise tests.integration.worker_apps:deploy_app`
# with the unit's and the manifest's own queue spec (queue "default"); the DSN comes from the command line.
deploy_app = App(None)


@deploy_app.job("deploy.noop", queue="default")
def deploy_noop(job):  # noqa: ANN001, ANN202
    return None
