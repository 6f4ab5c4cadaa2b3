"""Prometheus metrics for ``awa-fast supervise --metrics HOST:PORT`` (extra ``awa-fast[metrics]``).

Every scrape reads the supervisor's shared-memory segment: the claimers'
status records (counters, gauges, histograms) and the ring section the
maintenance process publishes (rings, prune outcomes, promotions, rescues).
No database query runs per scrape. The storage gauges (queue depth from the
lane heads, the DLQ size, dead tuples of the schema) come from
:class:`StorageGauges`, a thread that refreshes them every ``refresh_s``
seconds on its own connection, so a scrape storm costs the database nothing.

The shared-memory histograms keep fixed buckets: 40 for durations (50 us to
60 s, see :func:`awa_fast.runtime.shm.bucket_bounds`), 16 for job counts
(0, 1, 2, 4 ... 8192, see :func:`awa_fast.runtime.shm.size_bounds`); they are
exported with those edges as the ``le`` bounds, cumulated, never re-sampled. A claimer's
counters live in its record, which survives the claimer's restart, so the
counters only go up for the life of the supervisor.

The HTTP side (:func:`serve`) also answers ``/healthz`` (the process is
alive) and ``/readyz`` (:func:`awa_fast.health.check`), so one address
serves a load balancer, Kubernetes probes and Prometheus.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from awa_fast.errors import ConfigError

try:
    from prometheus_client.core import (
        CollectorRegistry,
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
except ImportError as exc:  # pragma: no cover - exercised by the extra's absence
    raise ImportError("awa-fast metrics need prometheus_client: pip install 'awa-fast[metrics]'") from exc

log = logging.getLogger("awa_fast.metrics")

PREFIX = "awa_fast"

# shared-memory counter -> (metric name without _total, help)
JOB_COUNTERS: dict[str, tuple[str, str]] = {
    "claimed": ("jobs_claimed", "Attempts claimed by the claimer."),
    "completed": ("jobs_completed", "Attempts durably completed."),
    "retried": ("jobs_retried", "Attempts closed as a retry (with backoff)."),
    "snoozed": ("jobs_snoozed", "Attempts closed as a snooze (no attempt consumed)."),
    "cancelled": ("jobs_cancelled", "Attempts closed as cancelled."),
    "failed": ("jobs_failed", "Attempts failed terminally (to the DLQ where the queue has one)."),
    "stale": ("jobs_stale", "Outcomes rejected because the attempt had been rescued or closed elsewhere."),
}
CALL_COUNTERS: dict[str, tuple[str, str]] = {
    "claim_calls": ("claim_calls", "Calls of the claim function."),
    "empty_claims": ("claim_empty", "Claim calls that returned no job."),
    "batches_flushed": ("completion_flushes", "Completion batcher flushes committed."),
    "heartbeat_failures": ("heartbeat_failures", "Heartbeat batches that failed (connection lost, database error)."),
}
# shared-memory gauge -> (metric name, help)
GAUGES: dict[str, tuple[str, str]] = {
    "in_flight": ("jobs_in_flight", "Attempts claimed and not yet handed to the batcher."),
    "waiting": ("jobs_waiting", "Attempts claimed and not started: buffered because every worker slot is busy."),
    "abandoned": ("handlers_abandoned", "Sync handlers still running although their attempt was rescued or timed out."),
}
# shared-memory histogram -> (metric name, help); the time ones in seconds, the size ones in jobs
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "pickup": ("pickup_latency_seconds", "From enqueue commit (database clock) to handler start."),
    "e2e": ("end_to_end_latency_seconds", "From enqueue commit (database clock) to durable completion."),
    "handler": ("handler_duration_seconds", "From handler start to handler return."),
    "flush_seconds": ("completion_flush_duration_seconds", "One completion flush, first write to commit."),
    "claim_seconds": ("claim_duration_seconds", "One call of the claim function."),
    "flush_jobs": ("completion_flush_jobs", "Outcomes written by one completion flush."),
    "claim_jobs": ("claim_batch_jobs", "Jobs returned by one call of the claim function."),
}
SIZE_HISTOGRAMS = frozenset({"flush_jobs", "claim_jobs"})
PRUNE_OUTCOMES = ("pruned", "empty", "busy", "blocked", "current", "retained")
RESCUE_KINDS = {"receipt": "rescued_receipt", "lease": "rescued_lease"}


def parse_bind(text: str, default_port: int = 9187) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``, ``PORT``) -> (host, port); the host defaults to loopback."""
    host, sep, port_s = text.rpartition(":")
    if not sep:
        host, port_s = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_s) if port_s else default_port
    except ValueError:
        raise ConfigError(f"bind address {text!r} must look like 127.0.0.1:9187") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"port {port} in {text!r} is out of range; use 0..65535")
    return host, port


@dataclass
class StorageGauges:
    """Database gauges refreshed on a timer (never per scrape): depth, DLQ size, dead tuples, leader."""

    dsn: str = field(repr=False)
    schema: str
    refresh_s: float = 15.0
    values: dict[str, Any] = field(default_factory=dict)
    refreshed_at: float = 0.0
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def refresh_once(self) -> None:
        """Read the gauges now (one short connection)."""
        from awa_fast.storage import Storage, connect

        storage = Storage(self.schema)
        try:
            with connect(self.dsn, application_name="awa_fast:metrics") as conn:
                values = {
                    "depth": storage.queue_depth_fast(conn),
                    "dlq": storage.dlq_depth(conn),
                    "key_waiting": {q: s["waiting"] for q, s in storage.queue_key_status(conn).items()},
                    "limits": storage.queue_limit_status(conn),
                    "dead_tuples": storage.dead_tuples(conn),
                    "leader": storage.leader_info(conn) is not None,
                }
        except Exception as exc:  # noqa: BLE001 - a gauge refresh never breaks the supervisor
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("storage gauges not refreshed: %s", self.error, extra={"action": "metrics_refresh_error"})
            return
        self.values = values
        self.refreshed_at = time.time()
        self.error = None

    def start(self) -> None:
        """Refresh now, then every ``refresh_s`` seconds on a daemon thread."""
        self.refresh_once()
        self._thread = threading.Thread(target=self._run, name="awa-metrics-gauges", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh_once()


class ShmCollector:
    """A prometheus_client collector over one shared-memory segment (and optional storage gauges)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None], gauges: StorageGauges | None = None) -> None:
        self._snapshot = snapshot
        self._gauges = gauges

    def describe(self) -> list[Metric]:
        return []  # dynamic labels: no fixed description (the registry is built with auto_describe=False)

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is not None:
            yield from _claimer_metrics(snap)
            yield from _ring_metrics(snap)
        if self._gauges is not None:
            yield from _storage_metrics(self._gauges)


def _claimer_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    claimers = [c for c in snap.get("claimers", []) if c.get("pid")]
    labels = ["queue", "stripe"]
    now = float(snap.get("now") or time.time())

    def family(kind: type, name: str, doc: str) -> Any:
        return kind(f"{PREFIX}_{name}", doc, labels=labels)

    for table in (JOB_COUNTERS, CALL_COUNTERS):
        for key, (name, doc) in table.items():
            fam = family(CounterMetricFamily, name, doc)
            for c in claimers:
                fam.add_metric([c["queue"], str(c["stripe"])], float(c.get(key, 0)))
            yield fam
    gauges = {key: family(GaugeMetricFamily, name, doc) for key, (name, doc) in GAUGES.items()}
    up = family(GaugeMetricFamily, "claimer_up", "1 while the claimer runs and published within 10 s.")
    alive = family(GaugeMetricFamily, "claimer_last_alive_timestamp_seconds", "When the claimer last published.")
    starts = family(CounterMetricFamily, "claimer_starts", "Times the claimer (re)started.")
    for c in claimers:
        lv = [c["queue"], str(c["stripe"])]
        for key, fam in gauges.items():
            fam.add_metric(lv, float(c.get(key, 0)))
        fresh = c.get("state") == "running" and now - float(c.get("last_alive", 0.0)) < 10.0
        up.add_metric(lv, 1.0 if fresh else 0.0)
        alive.add_metric(lv, float(c.get("last_alive", 0.0)))
        starts.add_metric(lv, float(c.get("starts", 0)))
    yield from (*gauges.values(), up, alive, starts)
    time_bounds = snap.get("histogram_bounds") or []
    size_bounds = snap.get("size_bounds") or []
    for key, (name, doc) in HISTOGRAMS.items():
        bounds = size_bounds if key in SIZE_HISTOGRAMS else time_bounds
        fam = family(HistogramMetricFamily, name, doc)
        for c in claimers:
            hist = c.get(key) or {}
            buckets = hist.get("buckets") or []
            fam.add_metric([c["queue"], str(c["stripe"])], cumulative_buckets(buckets, bounds),
                           sum_value=float(hist.get("sum", 0.0)))
        yield fam


def cumulative_buckets(counts: list[int], bounds: list[float]) -> list[tuple[str, float]]:
    """Shared-memory bucket counts (one per edge plus overflow) as Prometheus ``le`` buckets."""
    out: list[tuple[str, float]] = []
    running = 0
    for i, n in enumerate(counts):
        running += int(n)
        le = repr(float(bounds[i])) if i < len(bounds) else "+Inf"
        out.append((le, float(running)))
    if not out or out[-1][0] != "+Inf":
        out.append(("+Inf", float(running)))
    return out


def _ring_metrics(snap: dict[str, Any]) -> Iterator[Metric]:
    maint = snap.get("maintenance") or {}
    rings = maint.get("rings") or {}
    now = float(snap.get("now") or time.time())
    leader = GaugeMetricFamily(f"{PREFIX}_maintenance_leader",
                               "1 when this host's maintenance process holds the leader lock.")
    leader.add_metric([], 1.0 if maint.get("role") == "leader" else 0.0)
    yield leader
    tick = GaugeMetricFamily(f"{PREFIX}_maintenance_last_tick_timestamp_seconds",
                             "When the local maintenance process last ran a tick.")
    tick.add_metric([], float(maint.get("last_tick", 0.0)))
    yield tick
    slot = GaugeMetricFamily(f"{PREFIX}_ring_current_slot", "Current slot of the ring.", labels=["ring"])
    gen = GaugeMetricFamily(f"{PREFIX}_ring_generation", "Rotation generation of the ring.", labels=["ring"])
    age = GaugeMetricFamily(f"{PREFIX}_ring_slot_age_seconds", "Seconds since the ring last rotated.",
                            labels=["ring"])
    prune = GaugeMetricFamily(f"{PREFIX}_ring_prune_slots",
                              "Slots by outcome in the ring's last prune pass.", labels=["ring", "outcome"])
    prunes = CounterMetricFamily(f"{PREFIX}_prunes", "Slots by outcome over every prune pass of this host's "
                                 "maintenance process while it led.", labels=["ring", "outcome"])
    for ring, st in sorted(rings.items()):
        if int(st.get("current_slot", -1)) < 0:
            continue  # not published yet
        slot.add_metric([ring], float(st["current_slot"]))
        gen.add_metric([ring], float(st.get("generation", 0)))
        last = float(st.get("last_rotate", 0.0))
        if last > 0:
            age.add_metric([ring], max(0.0, now - last))
        for outcome in PRUNE_OUTCOMES:
            prune.add_metric([ring, outcome], float(st.get(f"prune_{outcome}", 0)))
    for ring, st in sorted(rings.items()):
        for outcome in PRUNE_OUTCOMES:
            prunes.add_metric([ring, outcome], float(st.get(f"total_{outcome}", 0)))
    yield from (slot, gen, age, prune, prunes)
    totals = maint.get("totals") or {}
    promotions = CounterMetricFamily(f"{PREFIX}_promotions",
                                     "Deferred jobs (scheduled, retryable, snoozed) promoted to ready by this host's "
                                     "maintenance process while it led.")
    promotions.add_metric([], float(totals.get("promoted", 0)))
    rescues = CounterMetricFamily(f"{PREFIX}_rescues", "Attempts rescued by this host's maintenance process while "
                                  "it led: receipt (heartbeat or deadline gone stale), lease (callback timed out).",
                                  labels=["kind"])
    for kind, key in RESCUE_KINDS.items():
        rescues.add_metric([kind], float(totals.get(key, 0)))
    yield from (promotions, rescues)


def _storage_metrics(g: StorageGauges) -> Iterator[Metric]:
    v = g.values
    depth = GaugeMetricFamily(f"{PREFIX}_queue_depth", "Jobs available to claim, from the lane heads.",
                              labels=["queue"])
    for q, n in sorted((v.get("depth") or {}).items()):
        depth.add_metric([q], float(n))
    yield depth
    dlq = GaugeMetricFamily(f"{PREFIX}_dlq_jobs", "Jobs in the dead-letter queue.", labels=["queue"])
    for q, n in sorted((v.get("dlq") or {}).items()):
        dlq.add_metric([q], float(n))
    yield dlq
    waiting = GaugeMetricFamily(f"{PREFIX}_key_waiting_jobs", "Jobs waiting on their concurrency key "
                                "(queues with key_max_running).", labels=["queue"])
    for q, n in sorted((v.get("key_waiting") or {}).items()):
        waiting.add_metric([q], float(n))
    yield waiting
    yield from _limit_metrics(v.get("limits") or {})
    if "dead_tuples" in v:
        dead = GaugeMetricFamily(f"{PREFIX}_dead_tuples", "Dead tuples over the schema's tables (slow gauge).")
        dead.add_metric([], float(v["dead_tuples"]))
        yield dead
    if "leader" in v:
        lead = GaugeMetricFamily(f"{PREFIX}_leader_present", "1 when some process holds the maintenance lock.")
        lead.add_metric([], 1.0 if v["leader"] else 0.0)
        yield lead
    at = GaugeMetricFamily(f"{PREFIX}_storage_gauges_refreshed_timestamp_seconds",
                           "When the storage gauges were last read from the database.")
    at.add_metric([], g.refreshed_at)
    yield at


def _limit_metrics(limits: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The fleet-wide flow-control state of the queues that have a limit (docs/flow-control.md)."""
    cap = GaugeMetricFamily(f"{PREFIX}_queue_max_running", "The queue's max_running (queues that set one).",
                            labels=["queue"])
    running = GaugeMetricFamily(f"{PREFIX}_queue_running", "Attempts running on a limited queue, fleet-wide "
                                "(open receipts and leases, as the claim counts them).", labels=["queue"])
    rate = GaugeMetricFamily(f"{PREFIX}_queue_rate_limit_per_second", "The queue's max_rate in jobs per second.",
                             labels=["queue"])
    tokens = GaugeMetricFamily(f"{PREFIX}_queue_rate_tokens", "Tokens left in the queue's rate bucket.",
                               labels=["queue"])
    for q, st in sorted(limits.items()):
        if st.get("max_running") is not None:
            cap.add_metric([q], float(st["max_running"]))
        running.add_metric([q], float(st.get("running", 0)))
        r = st.get("rate")
        if r is not None:
            rate.add_metric([q], float(r["count"]) / float(r["per"]))
        if st.get("tokens") is not None:
            tokens.add_metric([q], float(st["tokens"]))
    yield cap
    yield running
    yield rate
    yield tokens


def registry_for(snapshot: Callable[[], dict[str, Any] | None],
                 gauges: StorageGauges | None = None) -> CollectorRegistry:
    """A registry holding only awa-fast's collector (no process or platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ShmCollector(snapshot, gauges))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text of one scrape and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on one address, on a daemon thread."""

    def __init__(self, bind: tuple[str, int], registry: CollectorRegistry,
                 ready: Callable[[], tuple[bool, dict[str, Any]]] | None = None) -> None:
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from prometheus_client.exposition import ThreadingWSGIServer

        class _QuietHandler(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
                log.debug("metrics http: " + format, *args)

        self._registry = registry
        self._ready = ready
        self._server = make_server(bind[0], bind[1], self._app, ThreadingWSGIServer, handler_class=_QuietHandler)
        self.address: tuple[str, int] = self._server.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._server.serve_forever, name="awa-metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", *self.address, extra={"action": "metrics_start"})
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        import json

        path = environ.get("PATH_INFO", "/")
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")])
            return [b"only GET\n"]
        if path == "/metrics":
            body, ctype = render(self._registry)
            start_response("200 OK", [("Content-Type", ctype)])
            return [body]
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/readyz":
            ok, report = self._ready() if self._ready is not None else (True, {})
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [json.dumps(report, default=str).encode() + b"\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics, /healthz or /readyz\n"]


def check_bind(bind: tuple[str, int]) -> None:
    """Fail early, with one clear line, when the metrics address cannot be bound."""
    import socket

    family = socket.AF_INET6 if ":" in bind[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(bind)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {bind[0]}:{bind[1]} ({exc.strerror}); "
                              "pick another --metrics address") from None


def metrics_main(shm_name: str, bind: tuple[str, int], dsn: str, schema: str, home: str | None,
                 refresh_s: float = 15.0) -> None:
    """Entry point of the supervisor's metrics process: ``/metrics``, ``/healthz``, ``/readyz`` until SIGTERM.

    A child of its own, so the listening socket is never inherited by the
    claimers the supervisor forks; it attaches to the segment by name.
    """
    import os
    import pathlib
    import signal

    from awa_fast.health import check
    from awa_fast.runtime.claimer import die_with_parent
    from awa_fast.runtime.shm import ShmRing
    from awa_fast.runtime.stopflag import StopFlag

    die_with_parent()
    ring = ShmRing.attach(shm_name)
    gauges = StorageGauges(dsn, schema, refresh_s=refresh_s)
    gauges.start()

    def ready() -> tuple[bool, dict[str, Any]]:
        report = check(dsn, schema, pathlib.Path(home) if home else None)
        return report.healthy, report.to_dict()

    server = MetricsServer(bind, registry_for(ring.snapshot, gauges), ready).start()
    # lock-free: the handler runs on this thread, maybe inside stop.wait (see StopFlag)
    stop = StopFlag()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    parent = os.getppid()
    while not stop.wait(1.0):
        if os.getppid() != parent:
            break
    server.stop()
    gauges.stop()
    ring.close()
    os._exit(0)
