"""Network chaos through tests/chaos/proxy.py: drop, blackhole (half-open), delay/jitter, lost acknowledgements.

Workers reach PostgreSQL only through the proxy (its DSN is passed to
``supervise``); the test observes the database directly.
"""

from __future__ import annotations

import os
import time

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from awa_fast.storage import Storage
from awa_fast.storage.engine import _direct_statement
from tests.chaos.chaos_helpers import (
    Expect,
    Supervise,
    check_invariants,
    check_live,
    enqueue_many,
    one_pickup,
    open_claims,
    q,
    record_figures,
    supervisors,
    terminal_count,
    wait_terminal,
)
from tests.chaos.proxy import ChaosProxy
from tests.fixtures.waiting import wait_for

SCHEMA_PREFIX = "net"  # schema names of this module (the conftest fixture `schema`)


@pytest.fixture
def proxy(pg):
    p = ChaosProxy("127.0.0.1", pg.port, max_lifetime=300, passfile=pg.passfile).start()
    yield p
    p.stop()



def _sup(pg, proxy, schema, tmp_path, **kw) -> Supervise:
    # The cluster's real password (SCRAM through the proxy, no trust over TCP), given in the
    # DSN to prove it is never logged (see _assert_no_secret).
    # A short io timeout: a half-open connection is declared dead after 1.5 s of silence.
    kw.setdefault("extra_args", ("--io-timeout", "1.5"))
    return Supervise(proxy.dsn(password=pg.password), schema, tmp_path, **kw)


def _assert_no_secret(sup: Supervise) -> None:
    password = conninfo_to_dict(sup.dsn)["password"]
    assert password, "the supervisor's DSN carries the cluster's password"
    text = sup.log(since_start=False)
    assert password not in text, "the DSN password appears in the supervisor's log"


def test_the_proxy_is_no_way_around_the_password(pg, proxy):
    """Any local user can reach the proxy's port: what it forwards to must ask for the password."""
    plain = proxy.dsn(passfile=os.devnull, connect_timeout=10)  # no password from anywhere
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(plain)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(proxy.dsn(password="guess", connect_timeout=10))
    assert pg.password not in proxy.dsn()  # the file is named, never the password
    with psycopg.connect(proxy.dsn(connect_timeout=10), application_name="chaos:auth") as c:
        assert c.execute("SELECT inet_client_addr() IS NOT NULL, current_user").fetchone() == (True, "postgres")


def test_drop_every_connection_under_load(pg, proxy, obs, schema, tmp_path):
    n = 3000
    enqueue_many(pg.dsn, schema, n, {"sleep": 0.01})
    sup = _sup(pg, proxy, schema, tmp_path)
    with supervisors(sup.start()):
        wait_for(lambda: terminal_count(obs, schema) > 300, 20, "300 completions")
        proxy.drop_all()
        t_drop = time.monotonic()
        base = terminal_count(obs, schema)
        time.sleep(1.0)  # the outage lasts one second (a duration, not a wait for an event)
        proxy.set_pass()
        t_heal = time.monotonic()
        wait_for(lambda: terminal_count(obs, schema) > base + 100, 30, "progress after the outage")
        t_progress = time.monotonic() - t_heal
        wait_terminal(obs, schema, n, 60)
        t_all = time.monotonic() - t_heal
        check_live(obs, schema)
        assert sup.stop() == 0, sup.log()[-3000:]
    _assert_no_secret(sup)
    assert t_progress < 5.0, t_progress
    figures = check_invariants(obs, schema, Expect(n, {"completed": n}), sup.exec_log, sup.stale_rejected(),
                               supervisors_stopped=True)
    record_figures("proxy_drop_all_1s", progress_after_heal_s=round(t_progress, 2),
                   all_done_after_heal_s=round(t_all, 2),
                   outage_s=round(t_heal - t_drop, 2), refused=proxy.stats["refused"],
                   child_restarts=sup.log().count("restarting in"), **figures)


def test_batcher_connection_refused_briefly(pg, proxy, obs, schema, tmp_path):
    """Only the completion batcher's connections drop and are refused for 1 s: nothing may get stuck."""
    n = 2000
    enqueue_many(pg.dsn, schema, n, {"sleep": 0.01})
    sup = _sup(pg, proxy, schema, tmp_path)
    with supervisors(sup.start()):
        wait_for(lambda: terminal_count(obs, schema) > 300, 20, "300 completions")
        proxy.drop_all(match=r"^awa_fast:batcher:")
        time.sleep(1.0)  # outage duration
        proxy.set_pass()
        t_heal = time.monotonic()
        try:
            wait_terminal(obs, schema, n, 6, "every job to end within 6 s of the batcher's outage")
        finally:
            record_figures("proxy_batcher_refused_1s", terminal_6s_after_heal=terminal_count(obs, schema),
                           expected=n, open_claims=len(open_claims(obs, schema)),
                           batcher_thread_died="Exception in thread awa-batcher" in sup.log())
        t_all = time.monotonic() - t_heal
        assert sup.stop() == 0, sup.log()[-3000:]
    check_invariants(obs, schema, Expect(n, {"completed": n}), sup.exec_log, sup.stale_rejected(),
                     supervisors_stopped=True)
    record_figures("proxy_batcher_refused_1s", all_done_after_heal_s=round(t_all, 2))


def test_blackhole_claimer_and_listener(pg, proxy, obs, schema, tmp_path):
    """Half-open claim and LISTEN connections for 2 s: after the heal, work resumes within a bound."""
    sup = _sup(pg, proxy, schema, tmp_path, stripes=2, concurrency=8)
    with supervisors(sup.start()):
        n0 = enqueue_many(pg.dsn, schema, 200, {"sleep": 0.005})
        wait_terminal(obs, schema, n0, 20)
        proxy.blackhole(match=r"^awa_fast:(claimer|listen):")
        t_hole = time.monotonic()
        holed = [c for c in proxy.connections() if c[2]]
        assert len(holed) >= 3, proxy.connections()
        n1 = enqueue_many(pg.dsn, schema, 200, {"sleep": 0.005})
        time.sleep(2.0)  # the partition lasts two seconds
        proxy.set_pass()
        t_heal = time.monotonic()
        try:
            wait_terminal(obs, schema, n0 + n1, 6, "the jobs enqueued during the blackhole, within 6 s of the heal")
        finally:
            record_figures("proxy_blackhole_claimer_listener", done=terminal_count(obs, schema),
                           expected=n0 + n1, holed_connections=len(holed))
        t_all = time.monotonic() - t_heal
        assert sup.stop() == 0, sup.log()[-3000:]
    check_invariants(obs, schema, Expect(n0 + n1, {"completed": n0 + n1}), sup.exec_log, sup.stale_rejected(),
                     supervisors_stopped=True)
    record_figures("proxy_blackhole_claimer_listener", all_done_after_heal_s=round(t_all, 2),
                   blackhole_s=round(t_heal - t_hole, 2))


def test_blackhole_listener_alone_wakeups_resume(pg, proxy, obs, schema, tmp_path):
    poll = 2.0
    sup = _sup(pg, proxy, schema, tmp_path, stripes=1, concurrency=4, poll_interval=poll)
    lat: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    with supervisors(sup.start()):

        def one(phase: str) -> None:
            lat[phase].append(one_pickup(obs, schema, phase, poll))

        for _ in range(3):
            one("before")
        proxy.blackhole(match=r"^awa_fast:listen:")
        for _ in range(2):
            one("during")
        proxy.set_pass()
        t_heal = time.monotonic()
        try:
            # wakeups must come back within a bound (a re-LISTEN on a fresh connection)
            wait_for(lambda: (one("after") or True) and lat["after"][-1] < 0.3, 5,
                     "a wakeup-speed pickup after the heal", interval=0.0)
        finally:
            record_figures("proxy_blackhole_listener", pickup_before=lat["before"], pickup_during=lat["during"],
                           pickup_after=lat["after"])
        t_resumed = time.monotonic() - t_heal
        # one_pickup returns once the last job is claimed, maybe before its handler started: a drain
        # now would hand it back unrun. Stop only once every job has ended.
        total = sum(len(v) for v in lat.values())
        wait_terminal(obs, schema, total, 10)
        assert sup.stop() == 0
    # while the listener is dead, the poll still picks jobs up within its interval
    assert max(lat["during"]) <= poll + 0.5, lat
    check_invariants(obs, schema, Expect(total, {"completed": total}), sup.exec_log, sup.stale_rejected(),
                     supervisors_stopped=True)
    record_figures("proxy_blackhole_listener", wakeups_resumed_after_heal_s=round(t_resumed, 2))


def test_blackhole_listener_alone_poll_fallback(pg, proxy, obs, schema, tmp_path):
    """While the LISTEN connection is half-open, jobs are still picked up within the poll interval."""
    poll = 1.0
    sup = _sup(pg, proxy, schema, tmp_path, stripes=1, concurrency=4, poll_interval=poll)
    lat: list[float] = []
    with supervisors(sup.start()):
        wait_for(lambda: [c for c in proxy.connections() if c[1].startswith("awa_fast:listen:")], 10,
                 "the LISTEN connection")
        proxy.blackhole(match=r"^awa_fast:listen:")
        for _ in range(3):
            lat.append(one_pickup(obs, schema, "during", poll))
        proxy.set_pass()
        wait_terminal(obs, schema, 3, 10)
        assert sup.stop() == 0
    assert max(lat) <= poll + 0.5, lat
    check_invariants(obs, schema, Expect(3, {"completed": 3}), sup.exec_log, sup.stale_rejected(),
                     supervisors_stopped=True)
    record_figures("proxy_blackhole_listener_poll", pickup_s=[round(x, 3) for x in lat], poll_interval_s=poll)


def test_delay_and_jitter(pg, proxy, obs, schema, tmp_path):
    n = 800
    sup = _sup(pg, proxy, schema, tmp_path)
    with supervisors(sup.start()):
        enqueue_many(pg.dsn, schema, n, {"sleep": 0.002})
        t0 = time.monotonic()
        wait_terminal(obs, schema, n, 60)
        base_rate = n / (time.monotonic() - t0)
        proxy.delay(20, 15)
        enqueue_many(pg.dsn, schema, n, {"sleep": 0.002})
        t1 = time.monotonic()
        wait_terminal(obs, schema, 2 * n, 90)
        slow_rate = n / (time.monotonic() - t1)
        check_live(obs, schema)
        proxy.set_pass()
        assert sup.stop() == 0, sup.log()[-3000:]
    figures = check_invariants(obs, schema, Expect(2 * n, {"completed": 2 * n}), sup.exec_log,
                               sup.stale_rejected(), supervisors_stopped=True)
    # no rescue may fire just because the network is slow (heartbeats every 0.5 s, timeout 2 s)
    assert figures["rescued_attempts"] == 0, figures
    record_figures("proxy_delay_20ms_jitter_15ms", jobs_per_s_direct=round(base_rate),
                   jobs_per_s_delayed=round(slow_rate), **figures)


def test_lost_commit_ack_of_a_completion_batch(pg, proxy, obs, schema, tmp_path):
    """The completion COMMIT lands, its acknowledgement is lost: the batcher's replay changes nothing.

    The replay finds its completions done under their own run_lease and counts them as
    completed, not as stale outcomes (before, they were logged and counted as stale).

    The trigger is the COMMIT of a batched flush or, for a small flush sent as one autocommit
    statement, that statement (its answer is its acknowledgement). The small flush runs as a
    prepared statement through libpq: its first flush sends the text with the name (Parse), every
    later one only the name (Bind). The rule is armed after a first small flush, so it hits an
    execution, not the Parse (whose lost answer would leave nothing committed to find).
    """
    n, first = 400, 4
    sup = _sup(pg, proxy, schema, tmp_path, stripes=1, concurrency=8)
    statement = _direct_statement(Storage(schema).q["receipt_complete_rows"])[0]
    with supervisors(sup.start()):
        enqueue_many(pg.dsn, schema, first, {"sleep": 0.002})
        wait_terminal(obs, schema, first, 30)
        rule = proxy.lose_ack(r"^awa_fast:batcher:", (b"COMMIT", statement), close_after=0.3, count=1)
        enqueue_many(pg.dsn, schema, n - first, {"sleep": 0.002})
        wait_terminal(obs, schema, n, 30)
        wait_for(lambda: rule.fired, 5, "the lost acknowledgement")
        wait_for(lambda: sup.replayed_completions() >= 1, 10, "the replayed batch to find its own completions")
        check_live(obs, schema)
        assert sup.stop() == 0, sup.log()[-3000:]
    assert sup.stale_rejected() == 0, sup.log()[-3000:]
    figures = check_invariants(obs, schema, Expect(n, {"completed": n}), sup.exec_log, sup.stale_rejected(),
                               supervisors_stopped=True)
    assert figures["rescued_attempts"] == 0
    record_figures("proxy_lost_commit_ack", acks_lost=len(rule.fired), **figures)


def test_lost_ack_of_a_claim(pg, proxy, obs, schema, tmp_path):
    """A claim commits but its rows never reach the claimer: the attempts are rescued and run again."""
    n, first = 50, 4
    sup = _sup(pg, proxy, schema, tmp_path, stripes=1, concurrency=8)
    # The claim runs as a statement prepared once on the claimer's session (Storage.lane_claim_result):
    # a few jobs first, so that it is prepared; then the next claim's Bind message (it names the
    # statement, then its four parameter formats; a Parse has the query text there) loses its answer.
    statement = _direct_statement(Storage(schema).q["lane_claim"])[0]
    with supervisors(sup.start()):
        enqueue_many(pg.dsn, schema, first, {"sleep": 0.002})
        wait_terminal(obs, schema, first, 30)
        rule = proxy.lose_ack(r"^awa_fast:claimer:", b"\x00" + statement + b"\x00\x00\x04", close_after=0.2,
                              count=1)
        enqueue_many(pg.dsn, schema, n - first, {"sleep": 0.002})
        wait_for(lambda: rule.fired, 10, "the lost claim answer")
        t_lost = time.monotonic()
        wait_terminal(obs, schema, n, 30)
        t_all = time.monotonic() - t_lost
        check_live(obs, schema)
        assert sup.stop() == 0, sup.log()[-3000:]
    figures = check_invariants(obs, schema, Expect(n, {"completed": n}), sup.exec_log, sup.stale_rejected(),
                               supervisors_stopped=True)
    lost = q(obs, f"""SELECT count(*) FROM "{schema}_audit".claims c WHERE NOT EXISTS (
                          SELECT 1 FROM "{schema}_audit".terminal t WHERE t.job_id = c.job_id
                          AND t.run_lease = c.run_lease)""")[0][0]
    assert lost >= 1 and figures["rescued_attempts"] == lost, (lost, figures)
    record_figures("proxy_lost_claim_ack", claimed_never_delivered=lost, all_done_after_loss_s=round(t_all, 2),
                   **figures)
