"""SQL shipped with awa-fast: numbered migrations and named queries."""
