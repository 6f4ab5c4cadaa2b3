"""Fixtures shared by the chaos modules: a private cluster per module and an observer connection."""

from __future__ import annotations

import pytest

from tests.chaos.chaos_helpers import drop_schema, new_schema, start_cluster


@pytest.fixture(scope="module")
def pg(request, tmp_path_factory):
    """A private PostgreSQL (TCP on loopback) for one chaos module; modules may override it."""
    cc = start_cluster(tmp_path_factory.mktemp("pg-" + request.module.__name__.rsplit(".", 1)[-1]))
    yield cc
    cc.stop()


@pytest.fixture
def obs(pg):
    """An observer connection to the module's cluster."""
    c = pg.connect()
    yield c
    c.close()


@pytest.fixture
def schema(request, pg):
    """A fresh migrated schema on the module's cluster, named after the module's ``SCHEMA_PREFIX``."""
    s = new_schema(pg.dsn, getattr(request.module, "SCHEMA_PREFIX", "chaos"))
    yield s
    drop_schema(pg.dsn, s)
