"""``txn-redis``'s Redis calls: claim (XREADGROUP, XAUTOCLAIM), fetch by id (XRANGE), ack
(XACK), pending lists; the generic claim protocol is :mod:`.acknowledging`."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import SourceError
from .acknowledging import (
    Broker,
)
from .redis_rows import (
    FORMAT,
    BadMessageError,
    _bad_message_column,
    _fields_map,
    _json_columns,
    _json_document,
    _row_converter,
    fields_dict,
)

if TYPE_CHECKING:  # a type only: the options import this module (connect)
    from .redis_options import RedisSourceOptions

log = logging.getLogger(__name__)


_CHUNK = 1000  # ids per pipelined round trip
_FETCH_ROWS = 10_000  # messages per Arrow batch a read task yields
# What a claim received is kept (driver) for the read tasks of its batch up to this many
# messages; beyond it (a batch never planned in this process) the tasks fetch by id.
_KEEP_RECEIVED = 2_000_000


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _in_order(entries: list[str]) -> list[str]:
    """Entry ids sorted by (ms, seq); a claim's ids mostly are already (one sort check
    of cheap tuples instead of a key function call per id)."""
    keys = [(int(ms), int(seq or 0)) for ms, _, seq in (e.partition("-") for e in entries)]
    if all(a < b for a, b in pairwise(keys)):
        return entries
    return [e for _, e in sorted(zip(keys, entries, strict=True))]


def _stream_and_entry(ids: Sequence[str]) -> list[Any]:
    """The ``stream`` and ``id`` columns of message ids ``<stream>/<entry id>`` (split at
    the last ``/``, in Arrow rather than per id in Python)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = pc.extract_regex(pa.array(ids, pa.string()), r"(?s)^(?P<s>.*)/(?P<e>[^/]*)$")
    return [parts.field("s"), parts.field("e")]


def _raw_reply(response: Any, **options: Any) -> Any:
    """XREADGROUP and XRANGE replies as Redis sent them: entries ``[id, [name, value,
    ...]]`` with their fields flat, not one dict per entry (redis-py's parsing of those
    cost more than the rest of a read task's Python work)."""
    return response


def _streams_of(reply: Any) -> list[tuple[bytes, list]]:
    """(stream, entries) of an XREADGROUP reply, RESP2 (a list) or RESP3 (a map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return list(reply.items())
    return [(r[0], r[1]) for r in reply]


_PASSWORD_PARAM = re.compile(r"(?i)([?&]password=)[^&#]*")


def _safe_url(url: str) -> str:
    """The url without its password (user info or a ``password=`` query parameter, which
    redis-py also takes), for messages and logs."""
    url = _PASSWORD_PARAM.sub(r"\1***", url)
    if "://" not in url:  # not a URL: whatever precedes an @ may be a password
        return re.sub(r"^[^@/]*@", "***@", url)
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user, _, host = parts.netloc.rpartition("@")
    except ValueError:
        return "<unparsable url>"
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}"))


def _split_id(message_id: str) -> tuple[str, str]:
    stream, _, entry = message_id.rpartition("/")
    return stream, entry


def high_water(ids: Iterable[str], marks: Mapping[str, str]) -> dict[str, str]:
    """Per stream, the newest of ``ids`` and ``marks`` (stream -> ``<stream>/<entry id>``).

    Entry ids only grow in a stream and the group hands out new entries (``>``) in id
    order, so an entry at or below the mark that comes again by ``>`` was claimed
    before (the group's position was reset)."""
    out = dict(marks)
    for m in ids:
        s, entry = _split_id(m)
        if s not in out or _entry_key(entry) > _entry_key(_split_id(out[s])[1]):
            out[s] = m
    return out


def covered(marks: Mapping[str, str], message_id: str) -> bool:
    s, entry = _split_id(message_id)
    mark = marks.get(s)
    return mark is not None and _entry_key(entry) <= _entry_key(_split_id(mark)[1])


class RedisBroker(Broker):
    def __init__(self, cfg: RedisSourceOptions) -> None:
        self.cfg = cfg
        self._client: Any = None
        self._targets: dict[str, tuple[int, int]] | None = None  # Trigger.AvailableNow
        self._drained: set[str] = set()
        self._cursors: dict[str, str] = {}
        self._turn = 0
        # message id -> fields of the deliveries this connection received, until their
        # read task takes them or they are acked (see received)
        self._received: dict[str, dict] = {}

    @property
    def r(self):
        if self._client is None:
            client = self.cfg.client()
            for command in ("XREADGROUP", "XRANGE"):
                client.set_response_callback(command, _raw_reply)
            self._client = client
        return self._client

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import redis

        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise SourceError(
                f"{FORMAT}: cannot reach Redis at {_safe_url(self.cfg.url)} ({what}): {e}"
            ) from e
        except redis.RedisError as e:
            raise SourceError(
                f"{FORMAT}: Redis at {_safe_url(self.cfg.url)} refused {what}: {e}"
            ) from e

    def open(self, claimed: Sequence[str] = ()) -> None:
        import redis

        self._call("PING", self.r.ping)
        last: dict[str, str] = {}  # stream -> the newest entry the claim log holds
        for m in claimed:
            s, entry = _split_id(m)
            if s not in last or _entry_key(entry) > _entry_key(last[s]):
                last[s] = entry
        for s in self.cfg.streams:
            start = last.get(s, self.cfg.start_id)
            try:
                self.r.xgroup_create(s, self.cfg.group, id=start, mkstream=True)
                if s in last:
                    log.warning(
                        "%s: group %r was missing on stream %r although the claim log holds "
                        "entries of it (destroyed, or lost by the server): created again after "
                        "the last claimed entry %s, not at startId",
                        FORMAT,
                        self.cfg.group,
                        s,
                        start,
                    )
                else:
                    log.info(
                        "%s: created group %r on stream %r at %s", FORMAT, self.cfg.group, s, start
                    )
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise SourceError(
                        f"{FORMAT}: cannot create group {self.cfg.group!r} on stream {s!r} at "
                        f"{_safe_url(self.cfg.url)}: {e}"
                    ) from e
            except (redis.ConnectionError, redis.TimeoutError) as e:
                raise SourceError(
                    f"{FORMAT}: cannot reach Redis at {_safe_url(self.cfg.url)}: {e}"
                ) from e

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # closing only: nothing depends on it
                log.debug("closing the Redis client failed", exc_info=True)
            self._client = None

    # --- driver calls ------------------------------------------------------------

    def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[str]:
        res = self._call(
            "XREADGROUP",
            self.r.xreadgroup,
            self.cfg.group,
            self.cfg.consumer,
            streams,
            count=count,
            block=block,
        )
        out: list[str] = []
        for name, entries in _streams_of(res):
            s = name.decode()
            ids = [f"{s}/{e[0].decode()}" for e in entries]
            out.extend(ids)
            self._keep_received(zip(ids, (e[1] for e in entries), strict=True))
            if self._targets is not None and (
                len(entries) < count
                or (entries and _entry_key(entries[-1][0].decode()) >= self._targets[s])
            ):
                self._drained.add(s)
        return out

    def claim(self, max_messages: int, block_ms: int) -> list[str]:
        streams = [s for s in self.cfg.streams if s not in self._drained]
        if not streams:
            return []
        k = self._turn % len(streams)
        self._turn += 1
        out: list[str] = []
        for s in streams[k:] + streams[:k]:
            want = max_messages - len(out)
            if want <= 0:
                break
            got = self._read({s: ">"}, want, None)
            if self._targets is not None and not got:
                self._drained.add(s)
            out.extend(got)
        if not out and block_ms > 0 and self._targets is None:
            per = max(1, max_messages // len(streams))
            out = self._read({s: ">" for s in streams}, per, block_ms)
        return out

    def bound_to_now(self) -> None:
        targets = {}
        for s in self.cfg.streams:
            info = self._call("XINFO STREAM", self.r.xinfo_stream, s)
            last = info["last-generated-id"]
            targets[s] = _entry_key(last.decode() if isinstance(last, bytes) else str(last))
            if targets[s] == (0, 0):
                self._drained.add(s)
        self._targets = targets

    def consumer(self) -> str:
        return self.cfg.consumer

    def pending(self, consumers: Sequence[str] = ()) -> list[str]:
        out: list[str] = []
        for name in dict.fromkeys([self.cfg.consumer, *consumers]):
            for s in self.cfg.streams:
                low = "-"
                while True:
                    rows = self._call(
                        "XPENDING",
                        self.r.xpending_range,
                        s,
                        self.cfg.group,
                        low,
                        "+",
                        _CHUNK,
                        consumername=name,
                    )
                    ids = [r["message_id"].decode() for r in rows]
                    out.extend(f"{s}/{i}" for i in ids)
                    if len(ids) < _CHUNK:
                        break
                    low = f"({ids[-1]}"
        return out

    def reclaim(self, max_messages: int) -> list[str]:
        if self.cfg.claim_idle_ms is None:
            return []
        out: list[str] = []
        for s in self.cfg.streams:
            want = max_messages - len(out)
            if want <= 0:
                break
            res = self._call(
                "XAUTOCLAIM",
                self.r.xautoclaim,
                s,
                self.cfg.group,
                self.cfg.consumer,
                self.cfg.claim_idle_ms,
                start_id=self._cursors.get(s, "0-0"),
                count=want,
            )
            cursor, entries = res[0], res[1]
            self._cursors[s] = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            got = [(f"{s}/{e[0].decode()}", e[1]) for e in entries if e and e[1]]
            out.extend(m for m, _ in got)
            self._keep_received(got)
        return out

    def _keep_received(self, deliveries: Iterable[tuple[str, Any]]) -> None:
        """Hold what deliveries (message id, fields) carried for their read tasks, while
        fewer than ``_KEEP_RECEIVED`` are held."""
        keep = self._received
        if len(keep) < _KEEP_RECEIVED:
            keep.update((m, fields) for m, fields in deliveries if fields)

    def received(self, ids: Sequence[str]) -> list[Any] | None:
        """The fields of ``ids`` as ``XREADGROUP``/``XAUTOCLAIM`` handed them to this
        connection, if it holds every one (they leave it); None: fetch by id."""
        keep = self._received
        if not all(m in keep for m in ids):
            return None
        return [keep.pop(m) for m in ids]

    def _ranges(self, ids: Sequence[str]) -> list[tuple[str, list]]:
        """(id, entries) for each id, in order; entries is empty for an id the stream lacks,
        else one ``[entry id, [name, value, ...]]`` as Redis sent it (:func:`_raw_reply`).

        A claim is mostly a run of consecutive entries, so each stream's ids are read
        sorted, ``_CHUNK`` at a time, with one ``XRANGE first last COUNT n`` each
        (pipelined): one reply of n entries parses ~10x faster than n replies. Ids such
        a range does not return (entries of other consumers in between cut it short,
        or the entry is gone) are then read one by one.
        """
        wanted = set(ids)
        found: dict[str, list] = {}
        by_stream: dict[str, dict[str, str]] = {}  # stream -> entry id -> message id
        for m in dict.fromkeys(ids):  # in claim order: mostly sorted already
            s, entry = _split_id(m)
            by_stream.setdefault(s, {})[entry] = m
        pipe = self.r.pipeline(transaction=False)
        asked: list[tuple[str, list[str], dict[str, str]]] = []
        for s, names in by_stream.items():
            entries = _in_order(list(names))
            for i in range(0, len(entries), _CHUNK):
                chunk = entries[i : i + _CHUNK]
                pipe.xrange(s, chunk[0], chunk[-1], count=len(chunk))
                asked.append((s, chunk, names))
        for (s, chunk, names), got in zip(asked, self._call("XRANGE", pipe.execute), strict=True):
            if [e[0] for e in got] == [c.encode() for c in chunk]:  # the usual: a run
                found.update(zip([names[c] for c in chunk], ([e] for e in got), strict=True))
                continue
            for entry in got:
                m = f"{s}/{entry[0].decode()}"
                if m in wanted:
                    found[m] = [entry]
        rest = [m for m in dict.fromkeys(ids) if m not in found]
        for i in range(0, len(rest), _CHUNK):
            chunk = rest[i : i + _CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for m in chunk:
                s, entry = _split_id(m)
                pipe.xrange(s, entry, entry, count=1)
            found.update(zip(chunk, self._call("XRANGE", pipe.execute), strict=True))
        return [(m, found[m]) for m in ids]

    def missing(self, ids: Sequence[str]) -> set[str]:
        return {m for m, entries in self._ranges(ids) if not entries}

    def high_water(self, ids: Iterable[str], marks: Mapping[str, str]) -> dict[str, str]:
        return high_water(ids, marks)

    def covered(self, marks: Mapping[str, str], message_id: str) -> bool:
        return covered(marks, message_id)

    def ack(self, ids: Sequence[str]) -> None:
        by_stream: dict[str, list[str]] = {}
        for m in ids:
            self._received.pop(m, None)
            s, entry = _split_id(m)
            by_stream.setdefault(s, []).append(entry)
        pipe = self.r.pipeline(transaction=False)
        for s, entries in by_stream.items():
            for i in range(0, len(entries), _CHUNK):
                pipe.xack(s, self.cfg.group, *entries[i : i + _CHUNK])
        self._call("XACK", pipe.execute)

    # --- executor call -------------------------------------------------------------

    def fetch(self, ids: Sequence[str], arrow_schema) -> Iterator[Any]:
        def chunks() -> Iterator[tuple[Sequence[str], list[Any]]]:
            for i in range(0, len(ids), _FETCH_ROWS):
                got = self._ranges(ids[i : i + _FETCH_ROWS])
                gone = [m for m, entries in got if not entries]
                if gone:
                    raise SourceError(
                        f"{FORMAT}: {len(gone)} claimed messages no longer exist at "
                        f"{_safe_url(self.cfg.url)} (deleted or trimmed before their batch "
                        f"was read), e.g. {gone[:5]}: a replay cannot read them again; keep "
                        "unacknowledged entries in the stream (trim only acknowledged ones)"
                    )
                yield [m for m, _ in got], [entries[0][1] for _, entries in got]

        return self._batches(chunks(), arrow_schema)

    def fetch_received(self, ids: Sequence[str], received: Any, arrow_schema) -> Iterator[Any]:
        """The rows of ``ids`` from the entries the claim received (no Redis call): an
        entry never changes, so they are what ``XRANGE`` would return."""

        def chunks() -> Iterator[tuple[Sequence[str], list[Any]]]:
            for i in range(0, len(ids), _FETCH_ROWS):
                yield ids[i : i + _FETCH_ROWS], received[i : i + _FETCH_ROWS]

        return self._batches(chunks(), arrow_schema)

    def _batches(
        self, chunks: Iterable[tuple[Sequence[str], list[Any]]], arrow_schema
    ) -> Iterator[Any]:
        """Arrow record batches of fetched entries: message ids and, for each, its fields as
        Redis sent them (``[name, value, ...]``)."""
        import pyarrow as pa

        payload = list(arrow_schema)[2:]
        bad_type = payload.pop().type if self.cfg.bad_message_column is not None else None
        build = self._payload_builder(payload)
        for ids, fields in chunks:
            cols = _stream_and_entry(ids)
            payload_cols, bad = build(ids, fields)
            cols.extend(payload_cols)
            if bad:
                self._bad_messages(ids, bad)
            if bad_type is not None:
                cols.append(_bad_message_column(fields, bad, bad_type))
            yield pa.RecordBatch.from_arrays(cols, schema=arrow_schema)

    def _payload_builder(self, payload: list) -> Callable[[Sequence[str], list[Any]], Any]:
        """From fetched entries to (payload columns, {row: why it is a bad message})."""
        if self.cfg.payload_format != "json":

            def fields_map(ids: Sequence[str], fields: list[Any]) -> tuple[list[Any], dict]:
                column, bad = _fields_map(fields, payload[0].type)
                return [column], bad

            return fields_map
        convert = _row_converter(payload, self.cfg.required_columns)
        json_field = self.cfg.json_field

        def build(ids: Sequence[str], fields: list[Any]) -> tuple[list[Any], dict[int, str]]:
            rows: list[list[Any] | None] = []
            bad: dict[int, str] = {}
            for k, (m, f) in enumerate(zip(ids, fields, strict=True)):
                try:
                    doc = _json_document(m, fields_dict(f), json_field)
                    rows.append(convert(m, doc))
                except BadMessageError as e:
                    bad[k] = e.reason
                    rows.append(None)
            return _json_columns(rows, payload, bad), bad

        return build

    def _bad_messages(self, ids: Sequence[str], bad: Mapping[int, str]) -> None:
        """badMessages=fail: the first bad message fails the batch; column: a log line."""
        first = min(bad)
        m, why = ids[first], bad[first]
        more = f" (and {len(bad) - 1} more in this read task)" if len(bad) > 1 else ""
        if self.cfg.bad_message_column is None:
            raise SourceError(
                f"{FORMAT}: message {m}: {why}{more}. Its claim is durable, so every replay of "
                "this batch fails the same way: set option badMessages=column to read such "
                "messages as rows holding the error (docs/redis.md)"
            )
        log.warning(
            "%s: %d of %d messages could not be read and became rows with %s set, e.g. %s: %s",
            FORMAT,
            len(bad),
            len(ids),
            self.cfg.bad_message_column,
            m,
            why,
        )
