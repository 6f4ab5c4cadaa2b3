"""Apps for tests/integration/test_logs.py and test_proctitle.py (run under ``awa-fast supervise``).

``AWA_TEST_OWN_LOGGING=1`` makes the module configure logging itself when imported, as a user's app may.
"""

from __future__ import annotations

import logging
import os

from awa_fast.app import App

if os.environ.get("AWA_TEST_OWN_LOGGING"):
    logging.basicConfig(level=logging.INFO, format="USER %(levelname)s %(name)s %(message)s")

app = App()
user_log = logging.getLogger("user.handler")


@app.job("logs.say", queue="logq")
def say(job):  # noqa: ANN001, ANN202
    user_log.info("handling %s", job.args["word"])


@app.job("logs.say_async", queue="logq")
async def say_async(job):  # noqa: ANN001, ANN202
    user_log.info("handling async %s", job.args["word"])
