"""Periodic jobs: schedules declared in code, fired exactly once per due tick.

Declare with ``app.periodic(name, cron, kind, args)`` or stack
``@app.periodic("*/5 * * * *", name="report")`` on ``@app.job``. Cron is
five fields, or six with a leading seconds field, or an alias
(``@hourly``, ``@daily``, ...), evaluated in an IANA time zone by
`cronsim <https://pypi.org/project/cronsim/>`_ (the ``awa-fast[cron]``
extra), which follows cron's DST rules: a daily 02:30 fires once on the
spring-forward day (at 03:00, when 02:30 does not exist) and once on the
fall-back day (the first 02:30), while ``@hourly`` fires every real hour.

How a fire happens (storage in migration 0005):

- :func:`sync_schedules` upserts the app's schedules when a supervisor or
  in-process worker starts; schedules of the same source that left the code
  are disabled (kept, never deleted) with a log line.
- The maintenance leader calls :func:`evaluate_due` every tick. It reads the
  database clock and, per schedule, the newest fire in the ledger
  ``schedule_fires``; computes the due ticks since then (``missed="coalesce"``:
  the newest due tick only, the ones before it counted as coalesced;
  ``missed="catch_up"``: each, at most ``catch_up_cap``); and fires each with
  ``schedule_fire``, which writes the ledger row ``(schedule, tick)`` and
  enqueues the job in one transaction. A second evaluator (a leader that
  lost its lock mid-step, an operator's ``cron trigger``) conflicts on the
  ledger's primary key or finds the chain moved on, and enqueues nothing.
- All time comparisons are against the database clock: a host with a skewed
  clock computes the same ticks.
"""

from __future__ import annotations

import collections
import datetime as _dt
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg

from awa_fast.errors import ConfigError

if TYPE_CHECKING:
    from awa_fast.storage import Storage

log = logging.getLogger("awa_fast.periodic")

MISSED_POLICIES = ("coalesce", "catch_up")
CATCH_UP_CAP_DEFAULT = 100
#: Missed ticks counted one by one at most this many (a coalesced fire after a long outage says "at least").
COUNT_LIMIT = 100_000
#: Fires are kept this long (the newest of each schedule always), then pruned in batches.
FIRES_KEEP_S = 7 * 86400.0
PRUNE_INTERVAL_S = 60.0
EVALUATE_INTERVAL_S = 0.2

ALIASES: dict[str, str] = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError:
        raise ConfigError("periodic jobs need the cron extra: pip install 'awa-fast[cron]' (cronsim)") from None
    return cronsim


def normalize_cron(expr: str) -> str:
    """Expand an alias and check the expression parses (5 fields, or 6 with seconds first)."""
    if not isinstance(expr, str) or not expr.strip():
        raise ConfigError(f"cron expression {expr!r}: use five fields, six with seconds first, or an @alias")
    text = " ".join(expr.split())
    text = ALIASES.get(text.lower(), text)
    cronsim = _cronsim()
    try:
        cronsim.CronSim(text, _dt.datetime(2000, 1, 1, tzinfo=_dt.UTC))
    except cronsim.CronSimError as exc:
        raise ConfigError(f"cron expression {expr!r}: {exc}") from None
    return text


def zone(name: str) -> ZoneInfo:
    """The IANA zone ``name`` or :class:`ConfigError`."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ConfigError(f"unknown time zone {name!r}: use an IANA name such as 'UTC' or 'Europe/Berlin'") from None


def ticks_after(cron: str, tz: str, after: _dt.datetime) -> Iterator[_dt.datetime]:
    """Ticks strictly after ``after``, in order, as aware UTC datetimes."""
    cronsim = _cronsim()
    local = after.astimezone(zone(tz))
    for t in cronsim.CronSim(ALIASES.get(cron.strip().lower(), cron), local):
        yield t.astimezone(_dt.UTC)


def previous_tick(cron: str, tz: str, at: _dt.datetime) -> _dt.datetime | None:
    """The newest tick at or before ``at`` (UTC), or None."""
    cronsim = _cronsim()
    local = at.astimezone(zone(tz))
    # CronSim in reverse yields ticks at or before its start (strictly before a whole second with
    # microseconds stripped first); nudge one microsecond later so a tick exactly at ``at`` counts.
    it = cronsim.CronSim(ALIASES.get(cron.strip().lower(), cron), local + _dt.timedelta(microseconds=1),
                         reverse=True)
    for t in it:
        tick: _dt.datetime = t.astimezone(_dt.UTC)
        if tick <= at:
            return tick
    return None


@dataclass(frozen=True, slots=True)
class Fire:
    """One fire an evaluation decided on: ``tick``, the fire before it, and the ticks it folds in."""

    tick: _dt.datetime
    prev: _dt.datetime | None
    coalesced: int


def due_fires(cron: str, tz: str, missed: str, cap: int, start: _dt.datetime, prev: _dt.datetime | None,
              now: _dt.datetime) -> list[Fire]:
    """The fires due in ``(start, now]`` under the missed-tick policy (pure; the evaluator's core).

    ``start`` is the newest fire or the schedule's anchor; ``prev`` the
    newest fire (None before the first). ``coalesce``: one fire at the newest
    due tick, the earlier due ticks counted in ``coalesced``. ``catch_up``:
    one fire per due tick, at most ``cap`` (the newest ones; the older are
    counted in the first fire's ``coalesced``).
    """
    newest = previous_tick(cron, tz, now)
    if newest is None or newest <= start:
        return []
    if missed == "coalesce":
        skipped = 0
        for t in ticks_after(cron, tz, start):
            if t >= newest or skipped >= COUNT_LIMIT:
                break
            skipped += 1
        return [Fire(newest, prev, skipped)]
    window: collections.deque[_dt.datetime] = collections.deque(maxlen=cap)
    seen = 0
    for t in ticks_after(cron, tz, start):
        if t > now:
            break
        window.append(t)
        seen += 1
        if seen - cap >= COUNT_LIMIT:
            # too many to walk: keep the newest ``cap`` ending at ``newest``
            window = collections.deque(_last_ticks(cron, tz, newest, cap))
            break
    dropped = max(0, seen - len(window))
    due = list(window)
    fires = []
    for i, t in enumerate(due):
        fires.append(Fire(t, prev if i == 0 else due[i - 1], dropped if i == 0 else 0))
    return fires


def _last_ticks(cron: str, tz: str, newest: _dt.datetime, n: int) -> list[_dt.datetime]:
    cronsim = _cronsim()
    out = [newest]
    it = cronsim.CronSim(ALIASES.get(cron.strip().lower(), cron), newest.astimezone(zone(tz)), reverse=True)
    for t in it:
        t = t.astimezone(_dt.UTC)
        if t < newest:
            out.append(t)
        if len(out) >= n:
            break
    return sorted(out)


# -- declaration -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    """A periodic job as declared in code (``app.periodic``)."""

    name: str
    cron: str
    kind: str
    args: Any = None
    timezone: str = "UTC"
    queue: str | None = None
    priority: int | None = None
    missed: str = "coalesce"
    catch_up_cap: int = CATCH_UP_CAP_DEFAULT
    metadata: Any = None
    max_attempts: int | None = None
    unique: Any = None  # awa_fast.unique.Unique | False | None (None: the kind's default)
    extra: dict[str, Any] = field(default_factory=dict)


def declare(name: str, cron: str, kind: str, args: Any = None, *, timezone: str = "UTC", queue: str | None = None,
            priority: int | None = None, missed: str = "coalesce", catch_up_cap: int = CATCH_UP_CAP_DEFAULT,
            metadata: Any = None, max_attempts: int | None = None, unique: Any = None) -> Schedule:
    """Validate a schedule declaration (everything but the registry defaults) and return it."""
    from awa_fast.client import encode_payload, validate_max_attempts, validate_name, validate_priority

    validate_name("schedule", name)
    validate_name("kind", kind)
    if queue is not None:
        validate_name("queue", queue)
    if priority is not None:
        validate_priority(priority)
    if max_attempts is not None:
        validate_max_attempts(max_attempts)
    if missed not in MISSED_POLICIES:
        raise ConfigError(f"missed={missed!r}: use one of {MISSED_POLICIES}")
    if isinstance(catch_up_cap, bool) or not isinstance(catch_up_cap, int) or not 1 <= catch_up_cap <= 10_000:
        raise ConfigError(f"catch_up_cap={catch_up_cap!r}: use 1..10000")
    zone(timezone)
    encode_payload({} if args is None else args, "args")
    if metadata is not None:
        encode_payload(metadata, "metadata")
    return Schedule(name, normalize_cron(cron), kind, args, timezone, queue, priority, missed, catch_up_cap,
                    metadata, max_attempts, unique)


def schedule_row(app: Any, s: Schedule, source: str) -> dict[str, Any]:
    """The ``schedules`` row of a declaration, with the kind's registered defaults filled in."""
    from awa_fast.client import PRIORITY_DEFAULT, encode_payload
    from awa_fast.unique import Unique

    spec = getattr(app, "registry", {}).get(s.kind)
    queue = s.queue or (spec.queue if spec is not None else app.default_queue)
    priority = s.priority or (spec.priority if spec is not None else PRIORITY_DEFAULT)
    max_attempts = s.max_attempts or (spec.max_attempts if spec is not None else 25)
    args = encode_payload({} if s.args is None else s.args, "args")
    unique = s.unique
    if unique is None:
        unique = getattr(app, "unique_defaults", {}).get(s.kind)
    key = period = states = None
    if isinstance(unique, Unique):
        key, period, states = unique.key_for(s.kind, bytes(args), queue), unique.period, unique.mask
    return {"name": s.name, "cron": s.cron, "timezone": s.timezone, "kind": s.kind,
            "args": args, "metadata": None if s.metadata is None else encode_payload(s.metadata, "metadata"),
            "queue": queue, "priority": priority,
            "max_attempts": max_attempts, "missed": s.missed, "catch_up_cap": s.catch_up_cap,
            "unique_key": key, "unique_period": period, "unique_states": states, "source": source}


def app_source(app: Any) -> str:
    """The ``source`` recorded for an app's schedules (its reference, else its module)."""
    ref = getattr(app, "periodic_source", None)
    return str(ref) if ref else "code"


def sync_schedules(conn: psycopg.Connection, storage: Storage, app: Any,
                   source: str | None = None) -> dict[str, list[str]]:
    """Upsert the app's declared schedules and disable its schedules that left the code.

    Called once when a supervisor or worker starts (a one-line hook). Only
    schedules of the same ``source`` are disabled, so two apps sharing a
    schema keep each other's. Returns the names created, updated, unchanged
    and disabled. An app with no schedules and none in the database costs
    one statement.
    """
    src = source or app_source(app)
    declared: list[Schedule] = list(getattr(app, "schedules", {}).values())
    out: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": [], "disabled": []}
    with conn.transaction():
        for s in declared:
            row = schedule_row(app, s, src)
            what = storage.schedule_upsert(conn, row)
            out[what].append(s.name)
            if what != "unchanged":
                log.info("schedule %s %s (%s %s -> %s)", s.name, what, s.cron, s.timezone, s.kind,
                         extra={"action": "schedule_sync"})
        out["disabled"] = storage.schedule_disable_missing(conn, src, [s.name for s in declared])
    for name in out["disabled"]:
        log.warning("schedule %s is no longer declared by %s: disabled (kept; `awa-fast cron list` shows it)",
                    name, src, extra={"action": "schedule_disabled"})
    return out


def sync_app_schedules(conn: psycopg.Connection, storage: Storage, app_or_ref: Any) -> dict[str, list[str]]:
    """:func:`sync_schedules` for an App or a ``module:attr`` reference (the supervisor's hook)."""
    app = app_or_ref
    source = None
    if isinstance(app_or_ref, str):
        from awa_fast.runtime.loader import load_app

        app = load_app(app_or_ref)
        source = app_or_ref
    return sync_schedules(conn, storage, app, source or app_source(app))


# -- evaluation (the maintenance leader) ----------------------------------------------------


def evaluate_due(storage: Storage, conn: psycopg.Connection,
                 on_fire: Callable[[str, Fire, str, int | None], None] | None = None) -> int:
    """Fire every due tick of every active schedule; returns how many jobs were enqueued.

    ``conn`` is an autocommit connection (the leader's). Each schedule's
    fires commit in one transaction of their own, so a failing schedule
    never blocks the others. ``on_fire(name, fire, outcome, job_id)`` sees
    every attempt.
    """
    return evaluate(storage, conn, on_fire)[0]


def evaluate(storage: Storage, conn: psycopg.Connection,
             on_fire: Callable[[str, Fire, str, int | None], None] | None = None) -> tuple[int, int]:
    """:func:`evaluate_due`, also returning how many active schedules there are."""
    now, rows = storage.schedule_due_list(conn)
    if now is None:  # no active schedule
        return 0, 0
    enqueued = 0
    for name, cron, tz, missed, cap, anchor, last in rows:
        start = anchor if last is None or anchor > last else last
        try:
            fires = due_fires(cron, tz, missed, int(cap), start, last, now)
        except (ConfigError, ValueError) as exc:
            log.error("schedule %s cannot be evaluated: %s", name, exc, extra={"action": "schedule_error"})
            continue
        if not fires:
            continue
        fired = 0
        try:
            with conn.transaction():
                for f in fires:
                    outcome, job = storage.schedule_fire(conn, name, f.tick, f.prev, f.coalesced, cron, tz)
                    if on_fire is not None:
                        on_fire(name, f, outcome, job)
                    if outcome == "fired":
                        fired += 1
                    elif outcome != "held":
                        if outcome not in ("stale", "duplicate", "inactive"):
                            log.warning("schedule %s tick %s: %s", name, f.tick.isoformat(), outcome,
                                        extra={"action": "schedule_fire"})
                        raise _Stop(outcome)
                    if f.coalesced:
                        log.info("schedule %s fired %s, coalescing %d missed ticks", name, f.tick.isoformat(),
                                 f.coalesced, extra={"action": "schedule_coalesced"})
            enqueued += fired  # committed
        except _Stop:
            pass  # rolled back: another evaluator moved the chain; the next evaluation continues from it
    return enqueued, len(rows)


class _Stop(Exception):
    pass


def trigger(storage: Storage, conn: psycopg.Connection, name: str) -> tuple[str, int | None]:
    """Fire a schedule once now, outside its tick chain (``awa-fast cron trigger``)."""
    return storage.schedule_fire(conn, name, None, None, 0, "", "", True)


_last: dict[tuple[str, str], float] = {}
_active: dict[str, bool] = {}
_sweep_busy: dict[str, bool] = {}
IDLE_EVALUATE_INTERVAL_S = 2.0


def leader_step(storage: Storage, conn: psycopg.Connection) -> None:
    """The maintenance leader's hook, called every loop; runs each part on its own cadence.

    Evaluates due schedules every :data:`EVALUATE_INTERVAL_S` (every
    :data:`IDLE_EVALUATE_INTERVAL_S` while the schema has no active
    schedule), prunes the fire ledger every :data:`PRUNE_INTERVAL_S` and
    sweeps stale unique keys every ``unique.SWEEP_INTERVAL_S`` (every
    ``SWEEP_BUSY_INTERVAL_S`` while it finds stale keys), at most
    ``SWEEP_BUDGET_S`` a time. With no schedules and no unique keys each part
    is one cheap statement on the leader's connection; nothing here touches
    the claim or completion path.
    """
    import time

    from awa_fast import unique as _unique

    now = time.monotonic()
    schema = storage.schema

    def due(part: str, interval: float) -> bool:
        if now - _last.get((schema, part), -1e9) >= interval:
            _last[(schema, part)] = now
            return True
        return False

    if due("evaluate", EVALUATE_INTERVAL_S if _active.get(schema, True) else IDLE_EVALUATE_INTERVAL_S):
        _enqueued, schedules = evaluate(storage, conn)
        _active[schema] = schedules > 0
    if due("prune", PRUNE_INTERVAL_S):
        storage.schedule_fires_prune(conn, FIRES_KEEP_S, 1000)
    if due("unique_sweep", _unique.SWEEP_BUSY_INTERVAL_S if _sweep_busy.get(schema) else _unique.SWEEP_INTERVAL_S):
        swept, busy = _unique.sweep_once(storage, conn)
        _sweep_busy[schema] = busy or swept > 0


__all__ = ["ALIASES", "Fire", "Schedule", "declare", "due_fires", "evaluate", "evaluate_due", "leader_step",
           "normalize_cron", "previous_tick", "sync_app_schedules", "sync_schedules", "ticks_after", "trigger"]
