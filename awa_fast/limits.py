"""Flow control: fleet-wide limits of a queue, enforced in the claim (docs/flow-control.md).

- :class:`Rate` — a token bucket: ``Rate(100, per=1.0, burst=100)`` lets at
  most ``burst`` jobs start at once and ``count`` per ``per`` seconds after.
- :class:`QueueLimits` — the settings of one queue: ``max_running`` (open
  attempts over every worker, fleet-wide) and ``max_rate``.
- :func:`parse_rate` — the CLI spelling ``100/1s`` (``100/s``, ``5/250ms``,
  ``600/1m``).
- :class:`LimitWatch` — what a claimer uses to pick its claim call: the plain
  claim function while its queue has no limit (no extra cost at all), the
  limited wrapper ``lane_claim_limited`` while it has one, ``lane_claim_keyed``
  while it has ``key_max_running`` (per-key concurrency, migration 0012).
- :func:`check_concurrency_key`, :func:`check_key_max_running` — validation of
  the per-key settings, before anything is written. It re-reads the
  queue's settings every ``refresh`` seconds, on the claim connection,
  between claims.

The SQL lives in ``sql/0010_flow_control.sql`` and ``sql/0012_key_limits.sql``;
the storage calls are ``Storage.queue_limits_get``, ``queue_limits_set``,
``lane_claim_limited_result``, ``queue_limit_status`` and, for keys,
``Storage.queue_limits_read``, ``queue_key_limit_set``, ``lane_claim_keyed_result``,
``queue_key_status`` (``awa_fast/storage/keys.py``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from awa_fast.errors import ConfigError, InvalidName

if TYPE_CHECKING:
    from awa_fast.jobs import ClaimSnapshot
    from awa_fast.storage import Storage

# Settings are re-read this often by a claimer (seconds): a limit configured
# (or removed) takes effect on every claimer within about this long.
LIMIT_REFRESH_S = 2.0

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_RATE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)?\s*(ms|s|m|h)\s*")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` job starts per ``per`` seconds, with up to ``burst`` at once.

    ``burst`` defaults to ``count`` (one period's worth). Evaluated in the
    claim, on the database clock, for the whole fleet.
    """

    count: float
    per: float = 1.0
    burst: float | None = None

    def __post_init__(self) -> None:
        for name in ("count", "per"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"Rate {name}={v!r}: use a positive number")
        if self.burst is None:
            object.__setattr__(self, "burst", float(max(self.count, 1)))
        b = self.burst
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 1:
            raise ConfigError(f"Rate burst={b!r}: use a number >= 1 (jobs that may start at once)")

    @property
    def per_second(self) -> float:
        return self.count / self.per

    def __str__(self) -> str:
        return f"{_num(self.count)}/{_num(self.per)}s burst {_num(self.burst or 0)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def parse_rate(text: str, burst: float | None = None) -> Rate:
    """``"100/1s"`` (or ``100/s``, ``5/250ms``, ``600/1m``, ``10/1h``) as a :class:`Rate`."""
    m = _RATE_RE.fullmatch(text or "")
    if not m:
        raise ConfigError(f"rate {text!r}: write COUNT/PERIOD, e.g. 100/1s, 100/s, 5/250ms, 600/1m")
    count, n, unit = float(m.group(1)), float(m.group(2) or 1), m.group(3)
    return Rate(count, per=n * _UNITS[unit], burst=burst)


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """The flow-control settings of one queue (None: no such limit).

    ``key_max_running``: at most this many jobs of one ``concurrency_key`` run at once.
    """

    queue: str
    max_running: int | None = None
    max_rate: Rate | None = None
    key_max_running: int | None = None

    @property
    def limited(self) -> bool:
        return self.max_running is not None or self.max_rate is not None

    @property
    def keyed(self) -> bool:
        return self.key_max_running is not None


# Longest concurrency key, in characters (keys are compared and indexed as text).
MAX_KEY_CHARS = 255


def check_concurrency_key(value: object) -> str | None:
    """A concurrency key as given to enqueue: None, or a non-empty str of at most 255 characters.

    Raises :class:`awa_fast.errors.InvalidName` (a :class:`ConfigError`) otherwise, before anything is written.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidName("concurrency_key", value, f"use a str (got {type(value).__name__}), e.g. "
                          f"concurrency_key=f\"customer:{{id}}\", or None for no key")
    if not value or value.isspace():
        raise InvalidName("concurrency_key", value, "use a non-empty str, or None for no key")
    if len(value) > MAX_KEY_CHARS:
        raise InvalidName("concurrency_key", value[:40] + "...",
                          f"use at most {MAX_KEY_CHARS} characters (this one has {len(value)}); "
                          "hash a longer identity yourself")
    if "\x00" in value:
        raise InvalidName("concurrency_key", value, "NUL characters cannot be stored")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidName("concurrency_key", value, "lone surrogates cannot be stored") from None
    return value


def check_key_max_running(value: object) -> int | None:
    """``key_max_running`` as given to configure: None (no key limit) or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise ConfigError(f"key_max_running={value!r}: use an integer from 1 to 1000000 (jobs of one key "
                          "running at once), or None for no key limit; pause the queue to stop it")
    return value


def check_max_running(value: object) -> int | None:
    """``max_running`` as given to configure: None or an int >= 0 (0 stops claims)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"max_running={value!r}: use an integer >= 0, or None for no limit")
    return value


class _Keep:
    """Marker: leave this setting as it is."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "KEEP"


# The value of a configure argument that means "leave as it is" (App.configure_queue's too).
KEEP: Any = _Keep()


ClaimCall = Callable[["psycopg.Connection", str, int, int, int], "tuple[list[ClaimSnapshot], bool]"]


class LimitWatch:
    """Which claim call a claimer makes, from its queue's settings re-read every ``refresh`` s.

    ``claim_call(conn)`` returns ``storage.lane_claim_result`` (the plain
    claim) while the queue has no limit, ``storage.lane_claim_keyed_result``
    while it has ``key_max_running``, ``storage.lane_claim_limited_result``
    while it has another limit. A failed read keeps the previous answer; the next claim
    on a broken connection fails and reconnects as usual.
    """

    __slots__ = ("storage", "queue", "refresh", "limits", "_read_at")

    def __init__(self, storage: Storage, queue: str, refresh: float = LIMIT_REFRESH_S) -> None:
        self.storage = storage
        self.queue = queue
        self.refresh = refresh
        self.limits: QueueLimits | None = None
        self._read_at = -math.inf

    def claim_call(self, conn: psycopg.Connection) -> ClaimCall:
        now = time.monotonic()
        if now - self._read_at >= self.refresh:
            self._read_at = now
            try:
                self.limits = self.storage.queue_limits_read(conn, self.queue)
            except psycopg.Error:
                pass
        if self.limits is not None:
            if self.limits.keyed:
                return self.storage.lane_claim_keyed_result
            if self.limits.limited:
                return self.storage.lane_claim_limited_result
        return self.storage.lane_claim_result
