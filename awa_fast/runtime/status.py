"""``awa-fast status``: queues, claimers, rings and the leader.

Counters, gauges and histograms come from the status records in the
shared-memory segments of the supervisors running on this host, the local
maintenance totals from their ring sections (each found through its own locator file:
``supervisors`` lists all, ``local`` is the oldest of them); queue depth,
ring positions and the leader come from the database, which stays the
authority.
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
        "supervisors": [],
    }
    data["key_limits"] = storage.queue_key_status(conn)  # per-key concurrency: jobs waiting on a key
    if exact:
        data["counts"] = storage.queue_counts_exact(conn)
    if home is not None:
        data["supervisors"] = local_snapshots(home, storage.schema)
        data["local"] = data["supervisors"][0] if data["supervisors"] else None
    return data


def local_snapshots(home: pathlib.Path, schema: str) -> list[dict[str, Any]]:
    """The shared-memory snapshot of every live local supervisor of ``schema``, oldest first."""
    try:
        from awa_fast.runtime.shm import ShmRing, read_locators
    except ImportError:
        return []
    out = []
    for name, pid in read_locators(home, schema):
        try:
            ring = ShmRing.attach(name)
        except Exception:  # noqa: BLE001 - a vanished segment means that supervisor is gone
            continue
        try:
            snap = ring.snapshot()
        finally:
            ring.close()
        snap["supervisor_pid"] = pid
        out.append(snap)
    return out


def _local_snapshot(home: pathlib.Path, schema: str, pid: int | None = None) -> dict[str, Any] | None:
    """The snapshot of local supervisor ``pid`` (default: the oldest, what ``local`` shows); None without."""
    snaps = [s for s in local_snapshots(home, schema) if pid is None or s["supervisor_pid"] == pid]
    return snaps[0] if snaps else None


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
        keyed = data.get("key_limits", {}).get(name)
        if keyed:
            lines.append(f"  key limit {keyed['key_max_running']}: {keyed['waiting']} jobs waiting on "
                         f"{keyed['keys_waiting']} keys, {keyed['admitted']} admitted")
        for state, n in sorted(data.get("counts", {}).get(name, {}).items()):
            lines.append(f"  {state}: {n}")
    supervisors = data.get("supervisors")
    if supervisors is None:
        supervisors = [data["local"]] if data.get("local") else []
    for sup in supervisors:
        if len(supervisors) > 1:
            lines.append(f"supervisor pid {sup.get('supervisor_pid')}:")
        totals = (sup.get("maintenance") or {}).get("totals")
        if totals:
            lines.append(f"maintenance here ({sup['maintenance'].get('role')}): "
                         f"promoted {totals.get('promoted', 0)} "
                         f"rescued {totals.get('rescued_receipt', 0)} (receipt) "
                         f"{totals.get('rescued_lease', 0)} (lease)")
        for c in sup.get("claimers", []):
            lines.append(f"claimer {c.get('queue')}#{c.get('stripe')} pid {c.get('pid')} {c.get('state')}: "
                         f"claimed {c.get('claimed')} completed {c.get('completed')} stale {c.get('stale')} "
                         f"in flight {c.get('in_flight')} waiting {c.get('waiting', 0)} "
                         f"abandoned, still running {c.get('abandoned', 0)} "
                         f"heartbeat failures {c.get('heartbeat_failures', 0)}")
    return "\n".join(lines)


def latency_summary(snapshot: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Pickup, end-to-end and handler percentiles (ms) over every claimer of a shared-memory snapshot."""
    from awa_fast.runtime.shm import histogram_percentiles

    out: dict[str, dict[str, float | None]] = {}
    for which in ("pickup", "e2e", "handler"):
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
