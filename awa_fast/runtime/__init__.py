"""The awa-fast runtime: supervisor, claimers, completion batcher, heartbeats, maintenance."""
