"""``awa-fast job``, ``queue`` and ``dlq``: list, show and act on jobs, queues and dead letters."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from awa_fast.cli.context import _admin, _json_default, _out, _seconds
from awa_fast.errors import AwaFastError, ConfigError, UnknownJob


def _job_text(info: Any) -> str:
    lines = [f"job {info.job_id}: {info.state}",
             f"  kind {info.kind}, queue {info.queue}, priority {info.priority}",
             f"  attempt {info.attempt} of {info.max_attempts}, run_lease {info.run_lease}"]
    for label, value in (("created", info.created_at), ("run at", info.run_at), ("finished", info.finished_at),
                         ("callback timeout", info.callback_timeout_at)):
        if value is not None:
            lines.append(f"  {label} {value.isoformat()}")
    lines.append(f"  args {json.dumps(info.args, default=_json_default, sort_keys=True)}")
    if info.metadata is not None:
        lines.append(f"  metadata {json.dumps(info.metadata, default=_json_default, sort_keys=True)}")
    lines.append(f"  progress {json.dumps(info.progress, default=_json_default)}")
    lines.append(f"  result {json.dumps(info.result, default=_json_default)}")
    if info.error:
        lines.append(f"  error {info.error}")
    if info.errors:
        lines.append("  errors:")
        for err in info.errors:
            if isinstance(err, dict):
                when = f" at {err['at']}" if err.get("at") else ""
                lines.append(f"    attempt {err.get('attempt')}{when}: {err.get('error')}")
            else:
                lines.append(f"    {err}")
    return "\n".join(lines)


def cmd_job(args: argparse.Namespace) -> int:
    app, storage, conn = _admin(args)
    try:
        if args.action == "list":
            jobs = app.list_jobs(queue=args.queue, kind=args.kind, state=args.state, limit=args.limit,
                                 before_id=args.before, conn=conn)
            _out(args, [j.to_dict() for j in jobs],
                 "\n".join(f"{j.job_id} {j.state} {j.queue} {j.kind} attempt {j.attempt}/{j.max_attempts}"
                           for j in jobs) or "no jobs")
        elif args.action == "show":
            info = app.get_job(args.id, conn=conn)
            if info is None:
                raise UnknownJob(args.id)
            _out(args, info.to_dict(), _job_text(info))
        elif args.action == "cancel":
            result = storage.job_cancel(conn, args.id)
            _out(args, {"job_id": args.id, "result": result}, f"job {args.id}: {result}")
            return 0 if result in ("cancelled", "cancel_requested") else 1
        else:
            outcome = storage.job_retry(conn, args.id)
            if outcome is None:
                info = app.get_job(args.id, conn=conn)
                state = info.state if info else "unknown"
                raise AwaFastError(f"job {args.id} is {state}; only DLQ and scheduled, retryable or snoozed "
                                   "jobs can be retried")
            result = "retried" if outcome == "retried" else "due now"
            _out(args, {"job_id": args.id, "result": result}, f"job {args.id}: {result}")
    finally:
        conn.close()
    return 0


def _queue_text(s: Any) -> str:
    return (f"{s.queue}: {'paused' if s.paused else 'active'}, deadline {_seconds(s.deadline)}, "
            f"heartbeat timeout {_seconds(s.heartbeat_timeout)}, dlq {'on' if s.dlq else 'off'} "
            f"(retention {_seconds(s.dlq_retention)}), aging {_seconds(s.aging_interval)}, "
            f"{s.enqueue_shards} enqueue shards"
            + (f", at most {s.key_max_running} per concurrency key" if s.key_max_running else ""))


def _key_max(text: str) -> int:
    from awa_fast.limits import check_key_max_running

    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"--key-max-running {text!r}: use an integer >= 1, or 'none' to remove the limit") from None
    return check_key_max_running(n)  # type: ignore[return-value]


def cmd_queue(args: argparse.Namespace) -> int:
    app, _storage, conn = _admin(args)
    try:
        if args.action == "list":
            rows = app.list_queues(conn=conn)
            _out(args, [r.to_dict() for r in rows], "\n".join(_queue_text(r) for r in rows) or "no queues")
        elif args.action == "show":
            s = app.queue_settings(args.name, conn=conn)
            counts = app.counts(args.name, conn=conn)[args.name]
            text = _queue_text(s) + "\n  " + ", ".join(f"{k} {v}" for k, v in counts.items())
            _out(args, dict(s.to_dict(), counts=counts), text)
        elif args.action == "configure":
            from awa_fast.app import KEEP
            from awa_fast.limits import check_max_running, parse_rate

            deadline: Any = KEEP if args.deadline is None else (None if args.deadline == 0 else args.deadline)
            if args.burst is not None and args.max_rate is None:
                raise ConfigError("--burst needs --max-rate (e.g. --max-rate 100/1s --burst 20)")
            if args.max_running is None:
                max_running: Any = KEEP
            elif args.max_running == "none":
                max_running = None
            else:
                try:
                    max_running = check_max_running(int(args.max_running))
                except ValueError:
                    raise ConfigError(f"--max-running {args.max_running!r}: use an integer >= 0, "
                                      "or 'none' to remove the limit") from None
            rate: Any = KEEP if args.max_rate is None else (
                None if args.max_rate == "none" else parse_rate(args.max_rate, args.burst))
            key_max: Any = KEEP if args.key_max_running is None else (
                None if args.key_max_running == "none" else _key_max(args.key_max_running))
            s = app.configure_queue(args.name, deadline=deadline, heartbeat_timeout=args.heartbeat_timeout,
                                    dlq=args.dlq, dlq_retention=args.dlq_retention,
                                    aging_interval=args.aging_interval, enqueue_shards=args.enqueue_shards,
                                    history_retention=args.history_retention, max_running=max_running,
                                    max_rate=rate, key_max_running=key_max, conn=conn)
            _out(args, s.to_dict(), _queue_text(s))
        else:
            paused = args.action == "pause"
            ok = app.pause(args.name, conn=conn) if paused else app.resume(args.name, conn=conn)
            if not ok:
                raise AwaFastError(f"no queue {args.name!r}; `awa-fast queue list` shows the known queues")
            _out(args, {"queue": args.name, "paused": paused},
                 f"queue {args.name}: {'paused' if paused else 'resumed'}")
    finally:
        conn.close()
    return 0


def _confirm(prompt: str) -> bool:
    sys.stderr.write(prompt)
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")


def cmd_dlq(args: argparse.Namespace) -> int:
    app, storage, conn = _admin(args)
    try:
        if args.action == "list":
            rows = app.dlq_list(args.queue, args.limit, conn=conn)
            _out(args, [r.to_dict() for r in rows],
                 "\n".join(f"{r.job_id} {r.queue} {r.kind} attempt {r.attempt}: {r.reason[:120]}" for r in rows)
                 or "DLQ is empty")
            return 0
        if not args.id and not args.queue:
            raise ConfigError(f"dlq {args.action}: give --id ID (repeatable), --queue NAME, or both")
        ids = args.id or None
        if args.dry_run:
            selected = storage.dlq_select(conn, ids, args.queue, 1_000_000)
            verb = "retry" if args.action == "retry" else "purge"
            _out(args, {f"would_{verb}": [r["job_id"] for r in selected]},
                 "\n".join([f"would {verb} {len(selected)} jobs"] + [f"  {r['job_id']} {r['queue']} {r['kind']}: "
                                                                     f"{r['reason'][:100]}" for r in selected]))
            return 0
        if args.action == "retry":
            moved = app.dlq_retry(ids, args.queue, conn=conn)
            _out(args, {"retried": moved}, f"retried {len(moved)} jobs")
            return 0
        if ids is None and not args.yes:
            count = len(storage.dlq_select(conn, None, args.queue, 1_000_000))
            if not sys.stdin.isatty():
                raise ConfigError(f"dlq purge --queue {args.queue} deletes all {count} DLQ entries of the queue "
                                  "for good: add --yes to confirm (or --dry-run to list them)")
            if not _confirm(f"purge all {count} DLQ entries of queue {args.queue} for good? [y/N] "):
                sys.stderr.write("nothing purged\n")
                return 1
        purged = app.dlq_purge(ids, args.queue, conn=conn)
        _out(args, {"purged": len(purged)}, f"purged {len(purged)} jobs")
    finally:
        conn.close()
    return 0
