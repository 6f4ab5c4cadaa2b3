"""Enqueue: validated, encoded, written on the caller's connection.

Every check here runs before anything is written, so bad input raises a
typed error and leaves the caller's transaction usable. The one exception
in timing is a bulk enqueue of more than ``COPY_BLOCK`` (1,024) rows: its
payloads are checked block by block while the earlier rows stream to
PostgreSQL, so a bad one rolls back what that call wrote (its own savepoint
or transaction) before its error is raised; still nothing commits and the
caller's own work stays.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import orjson
import psycopg

from awa_fast import _impl
from awa_fast import unique as _unique
from awa_fast.errors import ConfigError, InvalidName, OutOfRange, PayloadError
from awa_fast.limits import check_concurrency_key
from awa_fast.progress import ProgressBar
from awa_fast.storage import RawJson, Storage, connect
from awa_fast.storage.copy_rows import COPY_BLOCK

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,99}")
PRIORITY_MIN, PRIORITY_MAX, PRIORITY_DEFAULT = 1, 4, 2
MAX_ATTEMPTS_MAX = 1000
MAX_DELAY_S = 10 * 365 * 86400.0
MAX_PAYLOAD_BYTES = 1 << 20  # 1 MiB of encoded JSON per args or metadata
MAX_DEPTH = 32


def validate_name(what: str, value: object) -> str:
    """Return a valid queue or kind name, else raise :class:`InvalidName`."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise InvalidName(what, value, "use 1-100 characters: letters, digits and _ . : - "
                          "(starting with a letter or digit)")
    return value


def validate_priority(priority: object) -> int:
    """Priorities are 1 (highest) to 4."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise OutOfRange("priority", priority, PRIORITY_MIN, PRIORITY_MAX)
    return priority


def validate_max_attempts(value: object) -> int:
    """At least one attempt, at most 1000."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ATTEMPTS_MAX:
        raise OutOfRange("max_attempts", value, 1, MAX_ATTEMPTS_MAX)
    return value


def validate_delay(seconds: object, what: str = "delay") -> float:
    """A finite, non-negative delay of at most ten years, in seconds."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or not 0 <= seconds <= MAX_DELAY_S:
        raise OutOfRange(what, seconds, 0, MAX_DELAY_S)
    return float(seconds)


def validate_run_at(run_at: object) -> _dt.datetime:
    """An aware datetime (naive ones are ambiguous and refused)."""
    if not isinstance(run_at, _dt.datetime) or run_at.tzinfo is None or run_at.utcoffset() is None:
        raise PayloadError("run_at must be a timezone-aware datetime", "run_at")
    return run_at


_PLAIN = (dict, list, tuple, str, int, float, bool, type(None))
# bytes stay bytes through to_builtins, so check_payload refuses them as before
# (base64-encode them yourself: a silent base64 would surprise the reader).
_KEEP_AS_IS = (bytes, bytearray, memoryview)


def to_plain(obj: Any) -> Any:
    """``obj`` as JSON builtins: msgspec Structs, dataclasses, attrs classes, datetime/date/time
    (ISO 8601), UUID and Decimal (strings), enums (their value), sets (lists) are converted;
    dicts, lists and scalars come back unchanged. Raise :class:`PayloadError` when it cannot be."""
    try:
        return msgspec.to_builtins(obj, builtin_types=_KEEP_AS_IS)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PayloadError(f"cannot be encoded as JSON ({exc})", "$") from None


def encode_payload(obj: Any, what: str = "args", limit: int = MAX_PAYLOAD_BYTES) -> RawJson:
    """Check and JSON-encode job args or metadata, or raise :class:`PayloadError`.

    Plain JSON values are checked as they are (the fast path). Anything
    else msgspec can encode (Structs, dataclasses, datetime, UUID, Decimal,
    nested inside dicts and lists too) is first converted to builtins by
    :func:`to_plain`, then given the very same checks: NaN/infinity, NUL
    and lone surrogates in strings, non-str keys, ints beyond 64 bits,
    nesting depth, and the encoded size limit.
    """
    if type(obj) not in _PLAIN:
        obj = to_plain(obj)
        _impl.check_payload(obj, MAX_DEPTH)
    else:
        try:
            _impl.check_payload(obj, MAX_DEPTH)
        except PayloadError:
            # a typed value nested in a plain container: convert, then the same check decides
            converted = to_plain(obj)
            if converted == obj:
                raise
            _impl.check_payload(converted, MAX_DEPTH)
            obj = converted
    try:
        data = orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise PayloadError(f"{what} cannot be encoded as JSON ({exc})", "$") from None
    if len(data) > limit:
        raise PayloadError(f"{what} is {len(data)} bytes of JSON, over the {limit}-byte limit", "$")
    return RawJson(data)


def encode_payloads(objs: Iterable[Any], what: str = "args", limit: int = MAX_PAYLOAD_BYTES) -> list[bytes]:
    """:func:`encode_payload` of every item (``None`` is ``{}``), in order, or raise its :class:`PayloadError`.

    The same checks, conversions and errors as one call per item: plain
    dicts and lists are checked and encoded in one accelerated loop
    (``dump_payloads``); any other item, and any item that loop declines
    (a typed value to convert, a bad value, an oversized one), goes through
    :func:`encode_payload` itself. The result holds ``bytes`` (some of them
    :class:`RawJson`); both are sent as jsonb.
    """
    items = objs if type(objs) is list else list(objs)
    out: list[bytes] = []
    n = len(items)
    i = 0
    while True:
        i = _impl.dump_payloads(items, i, out, MAX_DEPTH, limit, orjson.dumps)
        if i >= n:
            return out
        obj = items[i]
        out.append(encode_payload({} if obj is None else obj, what, limit))
        i += 1


def validate_chunk(chunk: object) -> int:
    """Rows per COPY of ``enqueue_many``: 1 to 1,000,000."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 1_000_000:
        raise OutOfRange("chunk", chunk, 1, 1_000_000)
    return chunk


def _no_unique_with_key(unique: object, keyed: bool) -> None:
    if unique and keyed:
        raise ConfigError("unique= and concurrency_key= cannot be combined yet: enqueue unique jobs without a "
                          "key, or keyed jobs without unique=")


def keys_for_rows(concurrency_key: str | Sequence[str | None] | None, n: int) -> list[str | None] | None:
    """The per-row keys of a bulk enqueue: None (no keys), one str for every row, or one key (or None) per row.

    Raises :class:`InvalidName` for a bad key and :class:`ConfigError` for a list of the wrong length.
    """
    if concurrency_key is None:
        return None
    if isinstance(concurrency_key, str):
        return [check_concurrency_key(concurrency_key)] * n
    if not isinstance(concurrency_key, Sequence):
        check_concurrency_key(concurrency_key)  # raises: neither a str nor a sequence of keys
    keys = [check_concurrency_key(k) for k in concurrency_key]
    if len(keys) != n:
        raise ConfigError(f"concurrency_key has {len(keys)} keys for {n} jobs: give one key per job "
                          "(None for a job without one), or a single str for all")
    return keys if any(k is not None for k in keys) else None


class Client:
    """Enqueue jobs into one awa-fast schema.

    Pass ``conn=`` to enqueue inside your own open psycopg transaction (the
    job commits or rolls back with your data); without it, the client uses
    its own connection to ``dsn`` and commits at once.
    """

    def __init__(self, dsn: str | None = None, schema: str = "awa_fast", *,
                 default_queue: str = "default", max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        self.storage = Storage(schema)
        self.dsn = dsn
        self.default_queue = validate_name("queue", default_queue)
        self.max_payload_bytes = max_payload_bytes
        self._conn: psycopg.Connection | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(schema={self.storage.schema!r})"

    def _own_conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            if self.dsn is None:
                raise PayloadError("no connection: pass conn= or create the client with a dsn", "conn")
            self._conn = connect(self.dsn, application_name="awa_fast:client")
        return self._conn

    def _conn_scope(self, conn: psycopg.Connection | None) -> contextlib.AbstractContextManager[psycopg.Connection]:
        """The caller's connection as it is, else the client's own (autocommit) one."""
        return contextlib.nullcontext(conn if conn is not None else self._own_conn())

    def close(self) -> None:
        """Close the client's own connection (not the ones passed in)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _prepare(self, kind: str, args: Any, queue: str | None, priority: int | None,
                 max_attempts: int | None, metadata: Any, run_at: _dt.datetime | None,
                 delay: float | None) -> tuple[str, int, str, RawJson, RawJson | None, int,
                                               _dt.datetime | None, float | None]:
        validate_name("kind", kind)
        q = validate_name("queue", queue if queue is not None else self.default_queue)
        prio = validate_priority(PRIORITY_DEFAULT if priority is None else priority)
        attempts = validate_max_attempts(25 if max_attempts is None else max_attempts)
        if run_at is not None and delay is not None:
            raise PayloadError("give run_at or delay, not both", "run_at")
        when = validate_run_at(run_at) if run_at is not None else None
        wait = validate_delay(delay) if delay is not None else None
        a = encode_payload({} if args is None else args, "args", self.max_payload_bytes)
        m = encode_payload(metadata, "metadata", self.max_payload_bytes) if metadata is not None else None
        return q, prio, kind, a, m, attempts, when, wait

    def enqueue(self, kind: str, args: Any = None, *, queue: str | None = None, priority: int | None = None,
                max_attempts: int | None = None, metadata: Any = None, run_at: _dt.datetime | None = None,
                delay: float | None = None, conn: psycopg.Connection | None = None,
                unique: _unique.Unique | bool | None = None, concurrency_key: str | None = None) -> int:
        """Enqueue one job; returns its id. With ``conn`` it joins that connection's transaction.

        ``unique=awa_fast.Unique(...)`` raises :class:`awa_fast.UniqueConflict` when another job holds the key.
        ``concurrency_key="customer:42"``: on a queue with ``key_max_running`` the job waits until
        fewer than that many jobs of its key run (docs/flow-control.md); elsewhere it has no effect.
        """
        key = check_concurrency_key(concurrency_key)
        _no_unique_with_key(unique, key is not None)
        q, prio, kind, a, m, attempts, when, wait = self._prepare(
            kind, args, queue, priority, max_attempts, metadata, run_at, delay)
        with self._conn_scope(conn) as target:
            if key is not None:
                return self.storage.job_enqueue_keyed(target, q, prio, kind, a, m, attempts, when, wait, key)
            if unique:
                return _unique.enqueue_one(self.storage, target, unique, q, prio, kind, a, m, attempts, when, wait)
            return self._enqueue_single(target, conn is None, q, prio, kind, a, m, attempts, when, wait)

    def _enqueue_single(self, target: psycopg.Connection, own: bool, queue: str, priority: int, kind: str,
                        args: RawJson, metadata: RawJson | None, max_attempts: int, run_at: _dt.datetime | None,
                        delay: float | None) -> int:
        """One plain enqueue (no unique key, no concurrency key) on ``target``; returns the job id.

        A caller's connection may be shared by several threads, and the client's own one is not
        promised to be thread-safe, so each call gets a new cursor (``conn.execute``).
        :class:`awa_fast.App` takes a faster path on its own pool's connections (``own``).
        """
        return self.storage.job_enqueue(target, queue, priority, kind, args, metadata, max_attempts, run_at, delay)

    async def enqueue_async(self, kind: str, args: Any = None, *, conn: psycopg.AsyncConnection | None,
                            queue: str | None = None, priority: int | None = None,
                            max_attempts: int | None = None, metadata: Any = None,
                            run_at: _dt.datetime | None = None, delay: float | None = None,
                            unique: _unique.Unique | bool | None = None, concurrency_key: str | None = None) -> int:
        """Enqueue one job on an async connection, inside its transaction.

        ``concurrency_key`` as in :meth:`enqueue`.
        """
        key = check_concurrency_key(concurrency_key)
        _no_unique_with_key(unique, key is not None)
        q, prio, kind, a, m, attempts, when, wait = self._prepare(
            kind, args, queue, priority, max_attempts, metadata, run_at, delay)
        async with self._aconn_scope(conn) as target:
            if key is not None:
                return await self.storage.job_enqueue_keyed_async(target, q, prio, kind, a, m, attempts, when, wait,
                                                                  key)
            if unique:
                return await _unique.enqueue_one_async(self.storage, target, unique, q, prio, kind, a, m, attempts,
                                                       when, wait)
            return await self._enqueue_single_async(target, conn is None, q, prio, kind, a, m, attempts, when, wait)

    def _aconn_scope(self, conn: psycopg.AsyncConnection | None
                     ) -> contextlib.AbstractAsyncContextManager[psycopg.AsyncConnection]:
        """The caller's async connection as it is (a client has no async connection of its own)."""
        if conn is None:
            raise PayloadError("no async connection: pass conn=", "conn")
        return contextlib.nullcontext(conn)

    async def _enqueue_single_async(self, target: psycopg.AsyncConnection, own: bool, queue: str, priority: int,
                                    kind: str, args: RawJson, metadata: RawJson | None, max_attempts: int,
                                    run_at: _dt.datetime | None, delay: float | None) -> int:
        """Async twin of :meth:`_enqueue_single`."""
        return await self.storage.job_enqueue_async(target, queue, priority, kind, args, metadata, max_attempts,
                                                    run_at, delay)

    def _prepare_many(self, kind: str, args_list: Iterable[Any], queue: str | None, priority: int | None,
                      max_attempts: int | None, metadata: Any, progress: Any, chunk: int,
                      stream: bool) -> tuple[str, int, list[Any], RawJson | None, int, Any, bool]:
        """The checked options, the items and whether they stream: encoded payloads, or (``stream`` and
        more than one COPY block of them) the items as given, for :meth:`Storage.job_enqueue_copy` to
        encode block by block while it streams them. Up to one block is checked and encoded here,
        before anything is written, so a small call needs no savepoint."""
        validate_chunk(chunk)
        validate_name("kind", kind)
        q = validate_name("queue", queue if queue is not None else self.default_queue)
        prio = validate_priority(PRIORITY_DEFAULT if priority is None else priority)
        attempts = validate_max_attempts(25 if max_attempts is None else max_attempts)
        m = encode_payload(metadata, "metadata", self.max_payload_bytes) if metadata is not None else None
        items: list[Any] = args_list if type(args_list) is list else list(args_list)
        streamed = stream and len(items) > COPY_BLOCK
        if not streamed:
            items = encode_payloads(items, "args", self.max_payload_bytes)
        if progress is True:
            progress = ProgressBar(len(items), f"enqueue {kind}")
        return q, prio, items, m, attempts, progress, streamed

    def _encoder(self) -> Callable[[Sequence[Any]], list[bytes]]:
        """What the streamed COPY calls on each block of items: :func:`encode_payloads` at this client's limit."""
        limit = self.max_payload_bytes
        return lambda block: encode_payloads(block, "args", limit)

    def enqueue_many(self, kind: str, args_list: Iterable[Any], *, queue: str | None = None,
                     priority: int | None = None, max_attempts: int | None = None, metadata: Any = None,
                     conn: psycopg.Connection | None = None, chunk: int = 50_000,
                     progress: Any = None, return_ids: bool = False,
                     unique: _unique.Unique | bool | None = None,
                     concurrency_key: str | Sequence[str | None] | None = None) -> int | list[int]:
        """Bulk-enqueue jobs of one kind by binary COPY; returns how many.

        ``concurrency_key``: one str for every job, or one key (or None) per
        job; keyed jobs go in one statement per chunk instead of COPY
        (see :meth:`enqueue` and docs/flow-control.md).

        With ``unique=awa_fast.Unique(...)`` duplicates (within the call or
        held by another job) are skipped and the result is a
        :class:`awa_fast.unique.UniqueManyResult` (an int: rows inserted,
        with ``inserted``, ``skipped`` and ``job_ids``).

        Every payload is checked and encoded before anything commits. A call
        of up to ``COPY_BLOCK`` (1,024) rows is checked before anything is
        written; a larger one streams its rows to PostgreSQL while the next
        ones are checked, and a bad payload raises its :class:`PayloadError`
        and undoes everything this call wrote (a savepoint inside the caller's transaction, which stays
        usable; the lane numbers it reserved stay unused, as after any
        rolled-back enqueue). Each ``chunk`` rows are one COPY into one lane,
        and the chunks of a call go to up to four successive enqueue shards of the queue
        (at most half its shards, so one call never holds every shard's lock),
        so several stripes claim a big backlog side by side (each chunk is
        claimed in its order; chunks are not ordered among themselves, as the
        rows of concurrent producers are not). With ``conn`` the rows join that transaction;
        otherwise they commit in one transaction on the client's connection. ``progress=True``
        draws a progress bar on stderr (when it is a terminal); a callable
        is called with the number of rows written so far. Returns how many,
        or the new job ids in order with ``return_ids=True``.
        """
        if concurrency_key is not None and not isinstance(concurrency_key, (str, Sequence)):
            check_concurrency_key(concurrency_key)
        q, prio, payloads, m, attempts, progress, streamed = self._prepare_many(
            kind, args_list, queue, priority, max_attempts, metadata, progress, chunk,
            stream=concurrency_key is None and not unique)
        keys = keys_for_rows(concurrency_key, len(payloads))
        _no_unique_with_key(unique, keys is not None)
        if keys is not None:
            with self._conn_scope(conn) as target:
                scope = target.transaction() if target.autocommit else contextlib.nullcontext()
                with scope:
                    got: list[int] = []
                    for start in range(0, len(payloads), chunk):
                        got.extend(self.storage.job_enqueue_keyed_many(
                            target, q, prio, kind, payloads[start:start + chunk], m, attempts,
                            keys[start:start + chunk]))
                        if progress is not None:
                            progress(len(got))
            return got if return_ids else len(got)
        if unique:
            with self._conn_scope(conn) as target:
                return _unique.enqueue_many(self.storage, target, unique, q, prio, kind, payloads, m, attempts,
                                            chunk, progress)
        done = 0
        ids: list[int] | None = [] if return_ids else None
        encode = self._encoder() if streamed else None
        with self._conn_scope(conn) as target, self.storage.enqueue_scope(target, savepoint=streamed):
            for start in range(0, len(payloads), chunk):
                part = payloads[start:start + chunk]
                rng = self.storage.job_enqueue_copy(target, q, prio, kind, part, m, attempts, encode,
                                                   spread=start // chunk)
                if ids is not None:
                    ids.extend(_range_ids(rng, len(part)))
                done += len(part)
                if progress is not None:
                    progress(done)
        return done if ids is None else ids

    async def enqueue_many_async(self, kind: str, args_list: Iterable[Any], *, conn: psycopg.AsyncConnection,
                                 queue: str | None = None, priority: int | None = None,
                                 max_attempts: int | None = None, metadata: Any = None, chunk: int = 50_000,
                                 progress: Any = None, return_ids: bool = False,
                                 unique: _unique.Unique | bool | None = None,
                                 concurrency_key: str | Sequence[str | None] | None = None) -> Any:
        """Async twin of :meth:`enqueue_many` on an async connection (joins its transaction)."""
        if concurrency_key is not None and not isinstance(concurrency_key, (str, Sequence)):
            check_concurrency_key(concurrency_key)
        q, prio, payloads, m, attempts, progress, streamed = self._prepare_many(
            kind, args_list, queue, priority, max_attempts, metadata, progress, chunk,
            stream=concurrency_key is None and not unique)
        keys = keys_for_rows(concurrency_key, len(payloads))
        _no_unique_with_key(unique, keys is not None)
        if keys is not None:
            got: list[int] = []
            kscope = conn.transaction() if conn.autocommit else contextlib.nullcontext()
            async with kscope:
                for start in range(0, len(payloads), chunk):
                    got.extend(await self.storage.job_enqueue_keyed_many_async(
                        conn, q, prio, kind, payloads[start:start + chunk], m, attempts, keys[start:start + chunk]))
                    if progress is not None:
                        progress(len(got))
            return got if return_ids else len(got)
        if unique:
            return await _unique.enqueue_many_async(self.storage, conn, unique, q, prio, kind, payloads, m,
                                                    attempts, chunk, progress)
        done = 0
        ids: list[int] | None = [] if return_ids else None
        encode = self._encoder() if streamed else None
        async with self.storage.enqueue_scope_async(conn, savepoint=streamed):
            for start in range(0, len(payloads), chunk):
                part = payloads[start:start + chunk]
                rng = await self.storage.job_enqueue_copy_async(conn, q, prio, kind, part, m, attempts, encode,
                                                               spread=start // chunk)
                if ids is not None:
                    ids.extend(_range_ids(rng, len(part)))
                done += len(part)
                if progress is not None:
                    progress(done)
        return done if ids is None else ids


def _range_ids(rng: Any, n: int) -> range:
    """Job ids of a COPY into one reserved lane range: ``(lane_id << 40) | lane_seq``."""
    base = (rng.lane_id << 40) | rng.first_seq
    return range(base, base + n)
