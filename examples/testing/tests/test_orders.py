"""The shop's tests: they use only awa_fast.testing (fixtures awa_dsn and awa_app, and its helpers)."""

from __future__ import annotations

import pytest
from shop.orders import place_order

from awa_fast.testing import assert_enqueued, assert_not_enqueued, drain, work_one


def test_placing_an_order_enqueues_its_follow_up_jobs(awa_app, db):
    order_id = place_order(db, "ada@example.com", "lamp", 2)
    assert_enqueued(awa_app, "send_receipt", {"order_id": order_id}, count=1)
    assert_enqueued(awa_app, "reserve_stock", {"sku": "lamp", "quantity": 2}, queue="stock")


def test_a_failed_order_enqueues_nothing(awa_app, db):
    with pytest.raises(ValueError):
        place_order(db, "ada@example.com", "lamp", 0)
    assert_not_enqueued(awa_app)
    assert db.execute("SELECT count(*) FROM orders").fetchone()[0] == 0


def test_drain_runs_the_jobs_and_reports_each_outcome(awa_app, db):
    order_id = place_order(db, "ada@example.com", "lamp", 500)
    result = drain(awa_app)
    outcomes = {r.kind: r.outcome for r in result}
    assert outcomes == {"send_receipt": "completed", "reserve_stock": "retried"}
    assert db.execute("SELECT receipt_sent FROM orders WHERE id = %s", (order_id,)).fetchone()[0] is True
    assert_enqueued(awa_app, "reserve_stock", count=1)  # its retry waits for the next delivery


def test_work_one_runs_exactly_one_job(awa_app, db):
    result = work_one(awa_app, "send_receipt", {"order_id": 0, "email": "not-an-address"})
    assert (result.outcome, result.state) in {("failed", "dlq"), ("failed", "failed")}
    assert "cannot mail" in result.error


def test_each_test_gets_a_fresh_schema(awa_app):
    assert_not_enqueued(awa_app)
    assert awa_app.storage.schema.startswith("awa_test_")
