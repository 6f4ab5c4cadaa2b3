"""Minimal settings: one PostgreSQL database (psycopg 3) from DATABASE_URL, no apps, no middleware."""

import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["DATABASE_URL"])

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "signup_site.urls"
INSTALLED_APPS: list[str] = []
MIDDLEWARE: list[str] = []
USE_TZ = True
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3 when installed
        "NAME": _db.get("dbname", ""),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    }
}
