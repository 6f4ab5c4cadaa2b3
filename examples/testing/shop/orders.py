"""Placing an order: the row and its jobs commit or roll back together."""

from __future__ import annotations

import psycopg

from shop.jobs import app


def place_order(conn: psycopg.Connection, email: str, sku: str, quantity: int) -> int:
    """Insert the order and enqueue its follow-up work in ``conn``'s transaction; returns the order id."""
    with conn.transaction():
        (order_id,) = conn.execute("INSERT INTO orders (email, sku, quantity) VALUES (%s, %s, %s) RETURNING id",
                                   (email, sku, quantity)).fetchone()
        app.enqueue("send_receipt", {"order_id": order_id, "email": email}, conn=conn)
        app.enqueue("reserve_stock", {"order_id": order_id, "sku": sku, "quantity": quantity}, conn=conn)
        if quantity <= 0:
            raise ValueError("quantity must be positive")  # rolls back the order and both jobs
    return order_id
