"""A tiny shop: orders are stored and their follow-up work is enqueued in one transaction."""
