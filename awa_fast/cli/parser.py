"""The argument parser: every command, its options and help, and the value types they accept."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

from awa_fast import cron_cli, logs
from awa_fast.cli.context import _env
from awa_fast.cli.db import cmd_db, cmd_migrate
from awa_fast.cli.jobs import cmd_dlq, cmd_job, cmd_queue
from awa_fast.cli.runtime import cmd_bench, cmd_health, cmd_serve, cmd_status, cmd_supervise

JOB_ID_MAX = 2**63 - 1


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (what went wrong and where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _job_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a job id (a whole number)") from None
    if not 1 <= value <= JOB_ID_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range; job ids are 1..{JOB_ID_MAX}")
    return value


def _int_range(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is out of range; use {low}..{high}")
        return value

    return parse


def _duration(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 10 * 365 * 86400:
        raise argparse.ArgumentTypeError(f"{text} is out of range; use 0..315360000 seconds")
    return value


def _log_levels(text: str) -> str:
    if text.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level; use DEBUG, INFO, WARNING or ERROR")
    return text.upper()


def build_parser() -> argparse.ArgumentParser:
    from awa_fast import __version__

    p = _Parser(prog="awa-fast", description="A fast PostgreSQL job queue.",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="examples:\n  awa-fast migrate\n  awa-fast supervise myapp.jobs:app\n"
                       "  awa-fast job list --state dlq\n\n"
                       "The DSN comes from --dsn, AWA_FAST_DSN, then DATABASE_URL (prefer the environment or\n"
                       "~/.pgpass over --dsn: a password on the command line shows in `ps`).")
    p.add_argument("--version", action="version", version=f"awa-fast {__version__}")
    p.add_argument("--log-level", type=_log_levels, default=_env("AWA_FAST_LOG_LEVEL") or "INFO",
                   help="DEBUG, INFO, WARNING or ERROR (also after the command)")
    p.add_argument("--log-format", type=logs.format_arg, default=_env("AWA_FAST_LOG_FORMAT") or "text",
                   help="text, or json: one object per line (also after the command)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def leaf(parent: Any, name: str, help_text: str, example: str, *, db: bool = True,
             json_flag: bool = True) -> argparse.ArgumentParser:
        sp: argparse.ArgumentParser = parent.add_parser(
            name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
            epilog="example:\n  " + example, formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--log-level", type=_log_levels, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.add_argument("--log-format", type=logs.format_arg, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if db:
            sp.add_argument("--dsn", help="PostgreSQL DSN (default: AWA_FAST_DSN, DATABASE_URL, else embedded)")
            sp.add_argument("--schema", default=None,
                            help="schema name (default: AWA_FAST_SCHEMA, else awa_fast)")
        sp.add_argument("--home", default=_env("AWA_FAST_HOME"), help="embedded server home")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="print JSON")
        return sp

    def group(name: str, help_text: str) -> Any:
        gp = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        gp.add_argument("--log-level", type=_log_levels, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        gp.add_argument("--log-format", type=logs.format_arg, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        return gp.add_subparsers(dest="action", required=True, parser_class=_Parser, metavar="ACTION")

    sp = leaf(sub, "migrate", "install or upgrade the schema (idempotent)", "awa-fast migrate --schema awa_fast")
    sp.add_argument("--ready-slots", type=int, default=16)
    sp.add_argument("--claim-slots", type=int, default=8)
    sp.add_argument("--lease-slots", type=int, default=8)
    sp.add_argument("--grant-runtime", action="append", default=[], metavar="ROLE",
                    help="grant ROLE what enqueue and supervise need (no DDL, no TRUNCATE); repeatable")
    sp.set_defaults(func=cmd_migrate)

    db = group("db", "manage the embedded PostgreSQL server")
    for action, text in (("start", "start the embedded server (it keeps running until `db stop`)"),
                         ("stop", "stop the embedded server"),
                         ("status", "say whether the embedded server runs (exit 1 if not)"),
                         ("url", "print the embedded server's DSN")):
        sp = leaf(db, action, text, f"awa-fast db {action}", db=False)
        sp.set_defaults(func=cmd_db)

    sp = leaf(sub, "supervise", "run claimers and maintenance for an app until SIGTERM/SIGINT",
              "awa-fast supervise myapp.jobs:app --queue email:stripes=2,concurrency=64", json_flag=False)
    sp.add_argument("app", help="module:attribute of the awa_fast.App")
    sp.add_argument("--queue", action="append", default=[],
                    help="NAME[:stripes=N,concurrency=M,batch=B] (repeatable; default: the app's queues)")
    sp.add_argument("--drain-timeout", type=float, default=float(_env("AWA_FAST_DRAIN_TIMEOUT") or 30))
    sp.add_argument("--poll-interval", type=float, default=1.0, help="claim poll fallback (s)")
    sp.add_argument("--heartbeat-interval", type=float, default=5.0, help="heartbeat period of held attempts (s)")
    sp.add_argument("--election-interval", type=float, default=1.0, help="standby leader election period (s)")
    sp.add_argument("--rescue-interval", type=float, default=1.0, help="leader rescue scan period (s)")
    sp.add_argument("--no-maintenance", action="store_true", help="run no maintenance process here")
    sp.add_argument("--metrics", metavar="HOST:PORT", default=None,
                    help="serve Prometheus /metrics, /healthz and /readyz there (needs awa-fast[metrics])")
    sp.add_argument("--io-timeout", type=float, default=10.0,
                    help="a claim, completion flush or LISTEN ping unanswered this long (s) is a dead connection")
    sp.add_argument("--no-listen", action="store_true",
                    help="poll only, no LISTEN/NOTIFY (e.g. behind a transaction-pooling proxy)")
    sp.set_defaults(func=cmd_supervise)

    sp = leaf(sub, "status", "show queues, claimers, rings and the leader (never starts the embedded server)",
              "awa-fast status --exact")
    sp.add_argument("--exact", action="store_true", help="also scan for exact per-state counts")
    sp.set_defaults(func=cmd_status)

    sp = leaf(sub, "health", "exit 0 when the database, schema, leader and this host's claimers are healthy",
              "awa-fast health --json --stale-after 10")
    sp.add_argument("--stale-after", type=_duration, default=10.0,
                    help="a local claimer silent this long (seconds) is unhealthy (default 10)")
    sp.add_argument("--require-local", action="store_true",
                    help="unhealthy when no supervisor runs on this host")
    sp.set_defaults(func=cmd_health)

    sp = leaf(sub, "serve", "serve the web dashboard and its JSON API (needs awa-fast[web])",
              "awa-fast serve --bind 127.0.0.1:8787 --read-only", json_flag=False)
    sp.add_argument("app", nargs="?", default=None, help="module:attribute of the awa_fast.App (optional)")
    sp.add_argument("--bind", default="127.0.0.1:8787", help="address to listen on (default 127.0.0.1:8787)")
    sp.add_argument("--read-only", action="store_true", help="hide and refuse every action")
    sp.add_argument("--token-file", default=None,
                    help="admin token file, created 0600 when missing (default $AWA_FAST_HOME/dashboard.token)")
    sp.set_defaults(func=cmd_serve)

    from awa_fast.records import JOB_STATES

    job = group("job", "list, show, cancel or retry jobs")
    sp = leaf(job, "list", "list jobs, newest id first", "awa-fast job list --queue email --state dlq --limit 20")
    sp.add_argument("--queue")
    sp.add_argument("--kind")
    sp.add_argument("--state", choices=JOB_STATES)
    sp.add_argument("--limit", type=_int_range(1, 10_000), default=100)
    sp.add_argument("--before", type=_job_id, default=None, metavar="ID", help="page: jobs with ids below ID")
    sp.set_defaults(func=cmd_job)
    for action, text in (("show", "show one job: state, attempts, args, progress, result and errors"),
                         ("cancel", "cancel a job (a running one is asked to stop); exit 1 if already terminal"),
                         ("retry", "run a DLQ, scheduled, retryable or snoozed job again now")):
        sp = leaf(job, action, text, f"awa-fast job {action} 2199023255553")
        sp.add_argument("id", type=_job_id)
        sp.set_defaults(func=cmd_job)

    queue = group("queue", "list, show, configure, pause or resume queues")
    sp = leaf(queue, "list", "list every queue with its settings (deadline included)", "awa-fast queue list")
    sp.set_defaults(func=cmd_queue)
    sp = leaf(queue, "show", "show one queue's settings and exact job counts", "awa-fast queue show email")
    sp.add_argument("name")
    sp.set_defaults(func=cmd_queue)
    sp = leaf(queue, "configure", "create or change a queue's settings (durations in seconds)",
              "awa-fast queue configure email --deadline 300 --heartbeat-timeout 30 --no-dlq")
    sp.add_argument("name")
    sp.add_argument("--deadline", type=_duration, help="per-attempt deadline (0: none)")
    sp.add_argument("--heartbeat-timeout", type=_duration)
    sp.add_argument("--dlq", dest="dlq", action="store_true", default=None, help="dead-letter failed jobs")
    sp.add_argument("--no-dlq", dest="dlq", action="store_false", help="fail jobs terminally instead")
    sp.add_argument("--dlq-retention", type=_duration)
    sp.add_argument("--aging-interval", type=_duration)
    sp.add_argument("--enqueue-shards", type=_int_range(1, 64))
    sp.add_argument("--history-retention", type=_duration,
                    help="seconds terminal jobs stay visible at least (the ready ring keeps the longest of all queues)")
    sp.add_argument("--max-running", help="at most N of this queue's jobs running at once over every worker; "
                                          "'none' removes the limit")
    sp.add_argument("--max-rate", help="at most COUNT/PERIOD jobs started, e.g. 100/1s; 'none' removes the limit")
    sp.add_argument("--burst", type=float, help="with --max-rate: jobs that may start at once (default COUNT)")
    sp.add_argument("--key-max-running", help="at most N jobs of one concurrency key running at once; "
                                              "'none' removes the limit (waiting jobs then run)")
    sp.set_defaults(func=cmd_queue)
    for action, text in (("pause", "stop claims on a queue (running jobs finish)"),
                         ("resume", "let claims on a paused queue start again")):
        sp = leaf(queue, action, text, f"awa-fast queue {action} email")
        sp.add_argument("name")
        sp.set_defaults(func=cmd_queue)

    dlq = group("dlq", "list, retry or purge dead-lettered jobs")
    sp = leaf(dlq, "list", "list dead-lettered jobs, newest first", "awa-fast dlq list --queue email --limit 20")
    sp.add_argument("--queue")
    sp.add_argument("--limit", type=_int_range(1, 10_000), default=100)
    sp.set_defaults(func=cmd_dlq, id=[])
    for action, text, example in (
            ("retry", "move dead-lettered jobs back to ready with fresh attempts (--id and --queue: both hold)",
             "awa-fast dlq retry --queue email --dry-run"),
            ("purge", "delete dead-lettered jobs for good (--id and --queue: both hold; a whole queue needs "
                      "--yes or a terminal's confirmation)", "awa-fast dlq purge --queue email --yes")):
        sp = leaf(dlq, action, text, example)
        sp.add_argument("--queue")
        sp.add_argument("--id", type=_job_id, action="append", default=[])
        sp.add_argument("--dry-run", action="store_true", help="print what would be touched; change nothing")
        if action == "purge":
            sp.add_argument("--yes", action="store_true", help="purge a whole queue without asking")
        sp.set_defaults(func=cmd_dlq)

    sp = leaf(sub, "bench", "run a benchmark scenario (see docs/performance.md)",
              "awa-fast bench drain --jobs 200000")
    sp.add_argument("scenario", choices=["drain", "bulk-enqueue", "concurrent-insert", "latency", "pinned-reader"])
    sp.add_argument("--jobs", type=int, default=20000)
    sp.add_argument("--rate", type=float, default=200.0)
    sp.add_argument("--seconds", type=float, default=20.0)
    sp.add_argument("--concurrency", type=int, default=64)
    sp.add_argument("--stripes", type=int, default=2)
    sp.add_argument("--batch", type=int, default=0,
                    help="claim batch of the bench's supervisor "
                         "(default 0: the supervise default, sized from the backlog)")
    sp.add_argument("--producers", type=int, default=10)
    sp.add_argument("--save", nargs="?", const=True, default=None, metavar="PATH",
                    help="also write the JSON: to PATH (a .json file or a directory), else to ./perf/results/")
    sp.add_argument("--reclaim-seconds", type=float, default=None, help="pinned-reader: reclaim wait after unpin")
    sp.add_argument("--payload-bytes", type=int, default=None, metavar="N",
                    help="drain, bulk-enqueue: pad each job's args to about N bytes of JSON")
    sp.add_argument("--rss-every", type=float, default=0.0, metavar="SECONDS",
                    help="latency, pinned-reader: sample every claimer's RSS this often (0: off)")
    sp.add_argument("--metrics", metavar="HOST:PORT", default=None,
                    help="drain: the supervisor serves Prometheus /metrics there (supervise --metrics)")
    sp.set_defaults(func=cmd_bench)
    cron_cli.add_parser(sub)  # awa-fast cron list|pause|resume|trigger (awa_fast/cron_cli.py)
    return p
