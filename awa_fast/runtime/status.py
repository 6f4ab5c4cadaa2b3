"""``awa-fast status``: queues, claimers, rings and the leader.

Counters and latency come from the shared-memory ring of a supervisor
running on this host (found through its locator file); queue depth, ring
positions and the leader come from the database, which stays the authority.
"""

from __future__ import annotations

import pathlib
from typing import Any

import psycopg

from awa_fast.storage import Storage


def collect_status(storage: Storage, conn: psycopg.Connection, home: pathlib.Path | None,
                   exact: bool = False) -> dict[str, Any]:
    """Everything ``status`` shows, as JSON-able data."""
    data: dict[str, Any] = {
        "schema": storage.schema,
        "depth": storage.queue_depth_fast(conn),
        "queues": storage.queue_list(conn),
        "rings": {k: {"slot": v["slot"], "generation": v["generation"], "slots": v["slots"],
                      "rotated_at": v["rotated_at"].isoformat()} for k, v in storage.ring_state(conn).items()},
        "leader": storage.leader_info(conn),
        "local": None,
    }
    if exact:
        data["counts"] = storage.queue_counts_exact(conn)
    if home is not None:
        data["local"] = _local_snapshot(home, storage.schema)
    return data


def _local_snapshot(home: pathlib.Path, schema: str) -> dict[str, Any] | None:
    try:
        from awa_fast.runtime.shm import ShmRing, read_locator
    except ImportError:
        return None
    found = read_locator(home, schema)
    if found is None:
        return None
    name, pid = found
    try:
        ring = ShmRing.attach(name)
    except Exception:  # noqa: BLE001 - a vanished segment means no local supervisor
        return None
    try:
        snap = ring.snapshot()
    finally:
        ring.close()
    snap["supervisor_pid"] = pid
    return snap


def format_status(data: dict[str, Any]) -> str:
    """A human-readable rendering of :func:`collect_status` output."""
    lines = [f"schema {data['schema']}"]
    leader = data.get("leader")
    lines.append(f"leader: pid {leader['pid']} ({leader['application_name']})" if leader else "leader: none")
    for ring, st in sorted(data["rings"].items()):
        lines.append(f"ring {ring}: slot {st['slot']}/{st['slots']} generation {st['generation']}")
    for q in data["queues"]:
        name = q["queue"]
        lines.append(f"queue {name}: depth {data['depth'].get(name, 0)}{' (paused)' if q['paused'] else ''}")
        for state, n in sorted(data.get("counts", {}).get(name, {}).items()):
            lines.append(f"  {state}: {n}")
    local = data.get("local")
    if local:
        for c in local.get("claimers", []):
            lines.append(f"claimer {c.get('queue')}#{c.get('stripe')} pid {c.get('pid')} {c.get('state')}: "
                         f"claimed {c.get('claimed')} completed {c.get('completed')} stale {c.get('stale')} "
                         f"in flight {c.get('in_flight')}")
    return "\n".join(lines)


def latency_summary(snapshot: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Pickup and end-to-end percentiles (ms) over every claimer of a shared-memory snapshot."""
    from awa_fast.runtime.shm import histogram_percentiles

    out: dict[str, dict[str, float | None]] = {}
    for which in ("pickup", "e2e"):
        total: list[int] = []
        for c in snapshot.get("claimers", []):
            buckets = c.get(which, {}).get("buckets", [])
            if not total:
                total = [0] * len(buckets)
            for i, n in enumerate(buckets):
                total[i] += n
        pct = histogram_percentiles(total) if total and sum(total) else {}
        out[which] = {k: (round(v * 1000, 3) if v is not None else None) for k, v in pct.items()}
    return out
