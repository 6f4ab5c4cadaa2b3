"""A minimal Django site that enqueues awa-fast jobs inside ``transaction.atomic()``.

Web:     DATABASE_URL=... uvicorn signup_site.asgi:application --app-dir examples/django_app
Worker:  DATABASE_URL=... DJANGO_SETTINGS_MODULE=signup_site.settings \\
         awa-fast supervise signup_site.jobs:awa --queue email      (from examples/django_app)
Table:   CREATE TABLE subscribers (id bigserial PRIMARY KEY, email text NOT NULL, confirmed_at timestamptz)
"""
