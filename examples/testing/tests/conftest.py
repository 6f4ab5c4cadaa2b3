"""The shop's own fixtures, on top of awa_fast.testing's (awa_dsn, awa_app): loaded by its entry point."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest


@pytest.fixture
def db(awa_dsn: str, awa_app) -> Iterator[psycopg.Connection]:  # noqa: ANN001
    """A connection for the shop's own tables (a fresh orders table per test)."""
    with psycopg.connect(awa_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS orders")
        conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, email text NOT NULL, sku text NOT NULL, "
                     "quantity int NOT NULL, receipt_sent boolean NOT NULL DEFAULT false)")
        yield conn
