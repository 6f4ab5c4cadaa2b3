"""The awa-fast app of the site: its handlers use Django's own database connection."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "signup_site.settings")
django.setup()  # a worker (`awa-fast supervise signup_site.jobs:awa`) imports this module first

from django.db import connection  # noqa: E402

from awa_fast.app import App  # noqa: E402

awa = App(os.environ["DATABASE_URL"], os.environ.get("AWA_FAST_SCHEMA", "awa_fast"))


@awa.job("send_confirmation", queue="email")
def send_confirmation(job) -> None:  # noqa: ANN001
    # (deliver the e-mail here) Django keeps one connection per worker thread.
    with connection.cursor() as cur:
        cur.execute("UPDATE subscribers SET confirmed_at = now() WHERE id = %s", [job.args["subscriber_id"]])
