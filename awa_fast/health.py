"""``awa-fast health`` and ``/readyz``: is this deployment able to run jobs right now?

Four checks, each cheap:

- ``database``: a connection opens within the timeout;
- ``schema``: the schema is migrated and not newer than this package;
- ``leader``: some process, on any host, holds the maintenance leader lock;
- ``claimers``: every claimer of the supervisor(s) on this host published
  to shared memory within ``stale_after`` seconds (a claimer publishes at
  least once per poll interval, 1 s by default, also when idle). A claimer
  that is stopped (SIGSTOP), wedged or dead goes stale.

The verdict is healthy only when every check passes. No local supervisor is
reported as such and passes, unless ``require_local`` asks for one.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_STALE_AFTER = 10.0


@dataclass(slots=True)
class Check:
    """One check's verdict and what it saw."""

    ok: bool
    detail: str


@dataclass(slots=True)
class HealthReport:
    """The verdict and every check, as ``awa-fast health --json`` prints it."""

    healthy: bool
    checks: dict[str, Check] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


def _local_snapshots(home: pathlib.Path, schema: str) -> list[dict[str, Any]]:
    from awa_fast.runtime.status import local_snapshots

    return local_snapshots(home, schema)


def claimers_check(snapshots: list[dict[str, Any]], stale_after: float, require_local: bool,
                   now: float | None = None) -> Check:
    """Every local claimer running and fresh; see the module docstring."""
    if not snapshots:
        return Check(not require_local, "no local supervisor found" +
                     (" (one is required)" if require_local else ""))
    now = time.time() if now is None else now
    problems: list[str] = []
    total = 0
    for snap in snapshots:
        if not snap.get("supervisor_alive", True):
            problems.append(f"supervisor {snap.get('supervisor_pid')} is gone")
            continue
        for c in snap.get("claimers", []):
            if not c.get("pid"):
                continue
            total += 1
            name = f"{c.get('queue')}#{c.get('stripe')} (pid {c.get('pid')})"
            age = now - float(c.get("last_alive") or 0.0)
            if c.get("state") not in ("running", "starting"):
                problems.append(f"claimer {name} is {c.get('state')}")
            elif age > stale_after:
                problems.append(f"claimer {name} last published {age:.1f}s ago (limit {stale_after:g}s)")
    if problems:
        return Check(False, "; ".join(problems))
    return Check(True, f"{total} claimer(s) fresh")


def check(dsn: str, schema: str, home: pathlib.Path | None, *, stale_after: float = DEFAULT_STALE_AFTER,
          require_local: bool = False, connect_timeout: int = 3) -> HealthReport:
    """Run every check; never raises for an unhealthy deployment (the report says why)."""
    from awa_fast.errors import AwaFastError
    from awa_fast.storage import Storage, connect

    report = HealthReport(healthy=False)
    storage = Storage(schema)
    try:
        conn = connect(dsn, application_name="awa_fast:health", connect_timeout=connect_timeout)
    except Exception as exc:  # noqa: BLE001 - every failure to connect is "unreachable"
        report.checks["database"] = Check(False, _first_line(exc))
    else:
        with conn:
            report.checks["database"] = Check(True, "reachable")
            try:
                storage.schema_check(conn)
                report.checks["schema"] = Check(True, f"schema {schema!r} is compatible")
            except AwaFastError as exc:
                report.checks["schema"] = Check(False, _first_line(exc))
            if report.checks["schema"].ok:
                try:
                    leader = storage.leader_info(conn)
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    report.checks["leader"] = Check(False, _first_line(exc))
                else:
                    report.checks["leader"] = (Check(True, f"pid {leader['pid']} ({leader['application_name']})")
                                               if leader else Check(False, "no maintenance leader"))
    snapshots = _local_snapshots(home, schema) if home is not None else []
    report.checks["claimers"] = claimers_check(snapshots, stale_after, require_local)
    report.healthy = all(c.ok for c in report.checks.values()) and "schema" in report.checks
    return report


def format_report(report: HealthReport) -> str:
    """One line per check, then the verdict."""
    lines = [f"{'ok  ' if c.ok else 'FAIL'} {name}: {c.detail}" for name, c in report.checks.items()]
    lines.append("healthy" if report.healthy else "unhealthy")
    return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
