"""``txn-redis``: Redis Streams consumer groups as an exactly-once Spark source.

The generic part (offsets are claim numbers, claims written safely before
the offset is returned, replays read the claimed ids, acks only for committed
batches, dedup of redeliveries) is :mod:`.acknowledging`; this module holds
only the Redis calls:

- claim: ``XREADGROUP GROUP <group> <consumer> COUNT n STREAMS <s> >``, one
  stream after the other (rotating) until the batch's budget is spent; with
  ``blockMs`` a last blocking read over every stream when nothing was there;
- fetch by id (executors): ``XRANGE <s> <id> <id>``, pipelined;
- ack: ``XACK``; pending (at start): ``XPENDING <s> <group> - + n <consumer>``;
  with ``claimIdleMs``: ``XAUTOCLAIM`` of messages idle that long (any
  consumer's), deduplicated against the claim log like every delivery.

Message ids in the claim log are ``<stream>/<entry id>``. The group is created
(with ``MKSTREAM``) from ``startId`` when missing. Rows are ``stream``,
``id`` and the payload: ``fields`` (every field as a string map) with
``payloadFormat=raw``, ``fields`` as ``map<string,binary>`` (values byte for
byte: protobuf, Avro) with ``payloadFormat=binary``, or the columns of the
declared ``schema`` parsed from the JSON document in the field ``jsonField``
with ``payloadFormat=json``.

A claimed message that cannot become a row (not UTF-8, not JSON, a value not
of its column's type, no value for a NOT NULL column) fails its batch with
``badMessages=fail`` (the default), and so every replay of it. With
``badMessages=column`` it becomes a row of its own: payload columns null, and
``badMessageColumn`` (``struct<error string, fields map<binary,binary>>``)
holding why and the entry's fields byte for byte. Both are a function of the
entry alone, so a replay yields the same row and the message is acked with its
batch like any other. Columns declared NOT NULL in ``schema`` are then checked
per message (a message without a value is a bad message) and reported
nullable: a bad message's row holds null there.

The claim log is ``claimLog`` or ``<checkpointLocation>/pyspark_txn/claims``
(see :mod:`.acknowledging`); its stream is ``redis:<group>``. The consumer
name defaults to ``txn-<hash of the claim log and group>``, so it changes when
the checkpoint moves or is copied. The claim log records every name its reader
used (before the first read under it), and recovery reads the pending lists of
all of them: messages delivered but not yet claimed when a reader died are
claimed after a move too. (Claim logs written before names were recorded know
only the names used since: after moving one of those, set ``consumer`` to the
old name once, or ``claimIdleMs`` reclaims them.)

Every option is checked before anything touches Redis: a bad one is a
:class:`~pyspark_txn.errors.ConfigError` naming the option and what is
allowed.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pyspark.sql.datasource import DataSource

from ..errors import ConfigError, SourceError
from ..faults import FaultPlan
from ..spark.options import parse_choice, parse_storage_options, reject_unknown_options
from .acknowledging import (
    AcknowledgingStreamReader,
    Broker,
    BrokerConfig,
    ClaimLogConfig,
    ack_committed,
)

log = logging.getLogger(__name__)

FORMAT = "txn-redis"
REDIS_OPTIONS = {
    "url": "redis://[user:password@]host:port/db, rediss:// (TLS) or unix:// (required)",
    "stream": "stream key, or several comma-separated (required)",
    "group": "consumer group; created from startId when missing (required)",
    "startId": "where a group this source creates starts: $ (default: new entries only), "
    "0 (the whole stream) or an entry id",
    "consumer": "consumer name (default: txn-<hash of the claim log and group>)",
    "maxMessagesPerBatch": "most messages per micro-batch (default 1000)",
    "blockMs": "wait this long for new messages when none is there (default 0: never wait)",
    "claimIdleMs": "also take over messages pending this long at any consumer of the group "
    "(XAUTOCLAIM; default: off)",
    "payloadFormat": "raw (default: fields map<string,string>), binary (fields "
    "map<string,binary>, byte for byte) or json (columns of schema)",
    "schema": "payloadFormat=json: DDL of the payload columns, e.g. 'user string, n int'",
    "jsonField": "payloadFormat=json: the field holding the JSON document (default json)",
    "badMessages": "fail (default: a message that cannot become a row fails its batch, and "
    "every replay) or column (it becomes a row: payload null, badMessageColumn set)",
    "badMessageColumn": "badMessages=column: name of the column struct<error string, fields "
    "map<binary,binary>> set on bad messages' rows (default _bad_message)",
    "claimLog": "URI of the claim log (a Delta table)",
    "checkpointLocation": "the query's checkpoint; the claim log is then "
    "<checkpointLocation>/pyspark_txn/claims",
    "claimLogStorageOptions": "JSON object of delta-rs storage options for the claim log",
    "username": "Redis ACL user (overrides the url's)",
    "password": "Redis password (overrides the url's)",
    "sslCaCerts": "rediss: CA bundle file",
    "sslCertfile": "rediss: client certificate file",
    "sslKeyfile": "rediss: client key file",
    "sslCertReqs": "rediss: required (default), optional or none",
    "sslCheckHostname": "rediss: true (default) or false",
    "socketTimeoutMs": "Redis socket timeout (default 10000; blockMs is added to it)",
    "faultInjection": "TESTS ONLY: crash plan, see pyspark_txn.faults",
}
_OPTION_NAMES = {k.lower(): k for k in REDIS_OPTIONS}
#: Spark's own readers' names for bad records, which users try first.
_SPARK_HINTS = {
    "mode": "badMessages (fail or column, as Spark's FAILFAST or PERMISSIVE)",
    "columnNameOfCorruptRecord": "badMessageColumn, with badMessages=column",
}
PAYLOAD_FORMATS = ("raw", "binary", "json")
BAD_MESSAGES = ("fail", "column")
DEFAULT_BAD_MESSAGE_COLUMN = "_bad_message"
BAD_MESSAGE_TYPE = "struct<error: string, fields: map<binary,binary>>"
_FIELDS_DDL = {"raw": "fields map<string,string>", "binary": "fields map<string,binary>"}
_ENTRY_ID = re.compile(r"^\d+(-\d+)?$")
_CHUNK = 1000  # ids per pipelined round trip
_FETCH_ROWS = 10_000  # messages per Arrow batch a read task yields


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


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


def _check_url(url: str) -> None:
    """What redis-py would only refuse when it connects: ports, the db number, query
    parameters (a ConfigError naming the url without its password)."""
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigError(
                f"{FORMAT}: option url={_safe_url(url)!r}: the path must be a database "
                f"number such as /0, got /{db}"
            )
    try:
        from redis.connection import parse_url
    except ImportError:  # redis-py missing: the reader names it when it connects
        return
    try:
        parse_url(url)
    except ValueError as e:
        problem = _PASSWORD_PARAM.sub(r"\1***", str(e))
        raise ConfigError(f"{FORMAT}: option url={_safe_url(url)!r}: {problem}") from None


_MAX_INT = 2**31 - 1  # what Redis takes as a COUNT or a timeout without complaint


def _int(opts: Mapping[str, str], key: str, name: str, default: int | None, minimum: int):
    raw = opts.get(key)
    if raw is None:
        return default
    try:
        n = int(str(raw).strip())
    except ValueError:
        n = minimum - 1
    if not minimum <= n <= _MAX_INT:
        raise ConfigError(
            f"{FORMAT}: option {name}={raw!r}: expected an integer from {minimum} to {_MAX_INT}"
        )
    return n


def _bool(opts: Mapping[str, str], key: str, name: str, default: bool) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    value = str(raw).strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"{FORMAT}: option {name}={raw!r}: expected true or false")
    return value == "true"


def _quote(name: str) -> str:
    """A column name as a DDL identifier."""
    return "`" + name.replace("`", "``") + "`"


_NOT_NULL = re.compile(r"(?i)\bnot\s+null\b")
_COLUMN_NAME = re.compile(r"(`(?:[^`]|``)*`|[^\s:`]+)")


@dataclass(frozen=True)
class _SchemaColumns:
    names: tuple[str, ...]
    not_null: tuple[str, ...]  # top-level columns declared NOT NULL
    nullable_ddl: str  # the DDL without them


def _schema_columns(ddl: str) -> _SchemaColumns:
    """The top-level columns of the ``schema`` option, which ones are NOT NULL, and the DDL
    with those NOT NULLs taken out.

    A source reports its schema as DDL and Spark parses it where no Python parser is at
    hand, so this only finds ``NOT NULL`` outside quotes, comments and nested types
    (``struct<a: int NOT NULL>`` stays: a bad row's struct is null as a whole). Should it
    miss one, the reader refuses the schema Spark parsed (``check_schema``).
    """
    masked, depth, i, n = [], 0, 0, len(ddl)
    while i < n:
        c = ddl[i]
        end, mask = -1, "\0"
        if c in "`'\"":  # `a``b`, 'it\'s': masked, they may hold anything
            end = i + 1
            while end < n and ddl[end] != c:
                end += 2 if c != "`" and ddl[end] == "\\" else 1
        elif ddl.startswith("--", i):
            end, mask = ddl.find("\n", i), "\1"
            end = n - 1 if end < 0 else end
        elif ddl.startswith("/*", i):
            end, mask = ddl.find("*/", i + 2), "\1"
            end = n - 1 if end < 0 else end + 1
        if end >= 0:
            end = min(end, n - 1)
            masked.append(mask * (end - i + 1))
            i = end + 1
            continue
        depth += (c in "<(") - (c in ">)")
        masked.append(c if depth == 0 else "\0")
        i += 1
    plain = "".join(masked)
    names: list[str] = []
    not_null: list[str] = []
    cuts: list[tuple[int, int]] = []
    start = 0
    for part in plain.split(","):
        stop = start + len(part)
        lead = start  # comments before the name
        while lead < stop and (plain[lead] == "\1" or plain[lead].isspace()):
            lead += 1
        m = _COLUMN_NAME.match(ddl, lead, stop)
        name = m.group(1) if m else ""
        if name.startswith("`"):
            name = name[1:-1].replace("``", "`")
        if name:
            names.append(name)
        for hit in _NOT_NULL.finditer(plain, start, stop):
            cuts.append(hit.span())
            if name and name not in not_null:
                not_null.append(name)
        start = stop + 1
    out, at = [], 0
    for a, b in cuts:
        out.append(ddl[at:a])
        at = b
    out.append(ddl[at:])
    return _SchemaColumns(tuple(names), tuple(not_null), "".join(out))


@dataclass(frozen=True)
class RedisSourceOptions(BrokerConfig):
    """Every ``txn-redis`` option, parsed and checked once; picklable (travels to executors)."""

    url: str = field(repr=False)  # may carry a password: describe() shows it without
    streams: tuple[str, ...]
    group: str
    consumer: str
    claim_log: ClaimLogConfig
    start_id: str = "$"
    max_messages_per_batch: int = 1000
    block_ms: int = 0
    claim_idle_ms: int | None = None
    payload_format: str = "raw"
    payload_ddl: str | None = None
    json_field: str = "json"
    bad_message_column: str | None = None  # badMessages=column; None: a bad message fails
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: tuple[tuple[str, Any], ...] = ()
    socket_timeout_ms: int = 10_000
    faults: FaultPlan = field(default_factory=FaultPlan, repr=False)  # tests only

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> RedisSourceOptions:
        opts = {k.lower(): v for k, v in options.items()}
        reject_unknown_options(FORMAT, opts, REDIS_OPTIONS, implicit=("path",), hints=_SPARK_HINTS)
        url = (opts.get("url") or "").strip()
        if not url:
            raise ConfigError(f"{FORMAT}: option url is required ({REDIS_OPTIONS['url']})")
        try:
            scheme = urlsplit(url).scheme
        except ValueError as e:
            raise ConfigError(f"{FORMAT}: option url={_safe_url(url)!r} is not a URL: {e}") from e
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(
                f"{FORMAT}: option url={_safe_url(url)!r}: expected a redis://, rediss:// or "
                "unix:// URL"
            )
        _check_url(url)
        streams = tuple(s.strip() for s in (opts.get("stream") or "").split(","))
        if not any(streams):
            raise ConfigError(
                f"{FORMAT}: option stream is required: a stream key or several, comma-separated"
            )
        if not all(streams) or len(set(streams)) != len(streams):
            raise ConfigError(
                f"{FORMAT}: option stream={opts['stream']!r}: expected distinct, non-empty "
                "comma-separated stream keys"
            )
        group = (opts.get("group") or "").strip()
        if not group:
            raise ConfigError(
                f"{FORMAT}: option group (the consumer group; created when missing) is required"
            )
        start_id = (opts.get("startid") or "$").strip()
        if start_id != "$" and not _ENTRY_ID.match(start_id):
            raise ConfigError(
                f"{FORMAT}: option startId={opts['startid']!r}: expected $ (new entries only), "
                "0 (the whole stream) or an entry id such as 1700000000000-0"
            )
        fmt = parse_choice(FORMAT, opts, "payloadFormat", PAYLOAD_FORMATS, "raw")
        ddl = (opts.get("schema") or "").strip() or None
        if fmt == "json" and ddl is None:
            raise ConfigError(
                f"{FORMAT}: payloadFormat=json needs option schema, the DDL of the payload "
                "columns (e.g. 'user string, amount double')"
            )
        if fmt != "json" and ddl is not None:
            raise ConfigError(
                f"{FORMAT}: option schema is only for payloadFormat=json; {fmt} rows are "
                f"stream, id, {_FIELDS_DDL[fmt]}"
            )
        if "jsonfield" in opts and fmt != "json":
            raise ConfigError(f"{FORMAT}: option jsonField is only for payloadFormat=json")
        json_field = (opts.get("jsonfield") or "json").strip()
        if not json_field:
            raise ConfigError(f"{FORMAT}: option jsonField must not be empty")
        bad_message_column = None
        if parse_choice(FORMAT, opts, "badMessages", BAD_MESSAGES, "fail") == "column":
            bad_message_column = DEFAULT_BAD_MESSAGE_COLUMN
        if "badmessagecolumn" in opts:
            if bad_message_column is None:
                raise ConfigError(
                    f"{FORMAT}: option badMessageColumn is only for badMessages=column "
                    "(badMessages is fail: a bad message fails its batch)"
                )
            bad_message_column = opts["badmessagecolumn"].strip()
            if not bad_message_column:
                raise ConfigError(f"{FORMAT}: option badMessageColumn must not be empty")
        if bad_message_column is not None:
            taken = ["stream", "id"]
            taken += list(_schema_columns(ddl).names) if ddl else ["fields"]
            if bad_message_column.lower() in {t.lower() for t in taken}:
                raise ConfigError(
                    f"{FORMAT}: option badMessageColumn={bad_message_column!r}: the rows "
                    f"already have a column of that name ({', '.join(taken)}); choose another"
                )
        ssl_opts = {
            "sslcacerts": "ssl_ca_certs",
            "sslcertfile": "ssl_certfile",
            "sslkeyfile": "ssl_keyfile",
            "sslcertreqs": "ssl_cert_reqs",
            "sslcheckhostname": "ssl_check_hostname",
        }
        ssl: dict[str, Any] = {}
        for key, kw in ssl_opts.items():
            if key not in opts:
                continue
            if scheme != "rediss":
                raise ConfigError(
                    f"{FORMAT}: TLS option {_OPTION_NAMES[key]} needs a rediss:// url "
                    f"(the url is {scheme}://)"
                )
            ssl[kw] = opts[key]
        if "ssl_cert_reqs" in ssl:
            reqs = str(ssl["ssl_cert_reqs"]).strip().lower()
            if reqs not in ("required", "optional", "none"):
                raise ConfigError(
                    f"{FORMAT}: option sslCertReqs={ssl['ssl_cert_reqs']!r}: expected required, "
                    "optional or none"
                )
            ssl["ssl_cert_reqs"] = reqs
        if "ssl_check_hostname" in ssl:
            ssl["ssl_check_hostname"] = _bool(opts, "sslcheckhostname", "sslCheckHostname", True)
        # A consumer group belongs to one stream in Redis: two readers with the same group
        # name on other streams are other groups, and must not share a claim-log stream.
        source_id = f"redis:{group}:{','.join(sorted(streams))}"
        claim_log = ClaimLogConfig.locate(
            FORMAT,
            opts,
            source_id,
            parse_storage_options(
                opts.get("claimlogstorageoptions"), FORMAT, "claimLogStorageOptions"
            ),
        )
        consumer = (opts.get("consumer") or "").strip()
        if "consumer" in opts and not consumer:
            raise ConfigError(f"{FORMAT}: option consumer must not be empty")
        if not consumer:
            digest = hashlib.sha256(f"{claim_log.uri}\n{source_id}".encode()).hexdigest()
            consumer = f"txn-{digest[:12]}"
        return cls(
            url=url,
            streams=streams,
            group=group,
            consumer=consumer,
            claim_log=claim_log,
            start_id=start_id,
            max_messages_per_batch=_int(
                opts, "maxmessagesperbatch", "maxMessagesPerBatch", 1000, 1
            ),
            block_ms=_int(opts, "blockms", "blockMs", 0, 0),
            claim_idle_ms=_int(opts, "claimidlems", "claimIdleMs", None, 0),
            payload_format=fmt,
            payload_ddl=ddl,
            json_field=json_field,
            bad_message_column=bad_message_column,
            username=opts.get("username") or None,
            password=opts.get("password") or None,
            ssl=tuple(sorted(ssl.items())),
            socket_timeout_ms=_int(opts, "sockettimeoutms", "socketTimeoutMs", 10_000, 1),
            faults=FaultPlan.parse(opts.get("faultinjection")),
        )

    # --- schema ------------------------------------------------------------------

    @property
    def ddl(self) -> str:
        """The stream's schema as DDL (Spark parses it: DDL of the payload included)."""
        if self.payload_format != "json":
            payload = _FIELDS_DDL[self.payload_format]
        elif self.bad_message_column is None:
            payload = str(self.payload_ddl)
        else:  # a bad message's row holds null in every payload column
            payload = _schema_columns(str(self.payload_ddl)).nullable_ddl
        if self.bad_message_column is not None:
            payload += f", {_quote(self.bad_message_column)} {BAD_MESSAGE_TYPE}"
        return f"stream string, id string, {payload}"

    @property
    def required_columns(self) -> tuple[str, ...]:
        """Columns declared NOT NULL in ``schema`` that the reported schema has nullable
        (badMessages=column): a message without a value for one is a bad message."""
        if self.bad_message_column is None or self.payload_ddl is None:
            return ()
        return _schema_columns(self.payload_ddl).not_null

    def check_schema(self, schema) -> None:
        """A schema set with ``.schema()`` must be the one the options describe."""
        from pyspark.sql.types import BinaryType, MapType, StringType, StructField, StructType

        names = [f.name for f in schema.fields]
        ok = names[:2] == ["stream", "id"] and len({n.lower() for n in names}) == len(names)
        ok = ok and all(isinstance(f.dataType, StringType) for f in schema.fields[:2])
        payload = schema.fields[2:]
        if self.bad_message_column is not None:
            bad = StructType(
                [
                    StructField("error", StringType()),
                    StructField("fields", MapType(BinaryType(), BinaryType())),
                ]
            )
            ok = ok and len(payload) > 1 and payload[-1].name == self.bad_message_column
            ok = ok and payload[-1].dataType == bad
            payload = payload[:-1]
        if self.payload_format != "json":
            value = StringType() if self.payload_format == "raw" else BinaryType()
            ok = ok and len(payload) == 1 and payload[0].name == "fields"
            ok = ok and payload[0].dataType == MapType(StringType(), value)
        if not ok:
            raise ConfigError(
                f"{FORMAT}: the stream's schema must be {self.ddl} (payloadFormat="
                f"{self.payload_format}); got {schema.simpleString()}: don't set .schema(), "
                "use the options payloadFormat and schema"
            )
        if self.bad_message_column is not None:
            required = [f.name for f in payload if not f.nullable]
            if required:  # our DDL scan missed a NOT NULL: the JVM would fail on a bad row
                raise ConfigError(
                    f"{FORMAT}: option schema: column(s) {', '.join(required)} stay NOT NULL, "
                    "which a bad message's row (badMessages=column) cannot fill; write "
                    "NOT NULL right after the column's type"
                )

    def reader(self, schema) -> AcknowledgingStreamReader:
        from ..spark.arrow import spark_to_arrow_schema

        self.check_schema(schema)
        arrow_schema = spark_to_arrow_schema(schema)
        if self.payload_format == "json":
            payload = list(arrow_schema)[2:]
            if self.bad_message_column is not None:
                payload.pop()
            for f in payload:
                _converter(f.type, f.name)  # refuse what JSON cannot fill before starting
        return AcknowledgingStreamReader(
            FORMAT,
            self,
            self.claim_log,
            arrow_schema,
            self.max_messages_per_batch,
            self.block_ms,
            self.faults,
        )

    # --- BrokerConfig ----------------------------------------------------------

    def describe(self) -> str:
        return f"Redis at {_safe_url(self.url)} (group {self.group!r})"

    def connect(self) -> RedisBroker:
        return RedisBroker(self)

    def split(self, ids: Sequence[str]) -> list[list[str]]:
        by_stream: dict[str, list[str]] = {}
        for m in ids:
            by_stream.setdefault(m.rsplit("/", 1)[0], []).append(m)
        return [chunk for group in by_stream.values() for chunk in BrokerConfig.split(self, group)]

    def client(self) -> Any:
        """A redis-py client (lazy: it connects at its first command)."""
        try:
            import redis
        except ImportError as e:
            raise ConfigError(f"{FORMAT} needs redis-py: pip install 'pyspark-txn[redis]'") from e
        kwargs: dict[str, Any] = dict(self.ssl)
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        timeout = (self.socket_timeout_ms + self.block_ms) / 1000
        return redis.Redis.from_url(
            self.url,
            socket_timeout=timeout,
            socket_connect_timeout=self.socket_timeout_ms / 1000,
            decode_responses=False,
            **kwargs,
        )


def ack_committed_offset(options: Mapping[str, str], end: Mapping | str) -> int:
    """For sinks: acknowledge the claims of a committed batch, given the reader's options."""
    opts = RedisSourceOptions.parse(options)
    return ack_committed(opts, opts.claim_log, end)


# --- the broker ---------------------------------------------------------------------------


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

    @property
    def r(self):
        if self._client is None:
            self._client = self.cfg.client()
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
        for name, entries in res or []:
            s = name.decode()
            out.extend(f"{s}/{e[0].decode()}" for e in entries)
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
            out.extend(f"{s}/{e[0].decode()}" for e in entries if e and e[1])
        return out

    def _ranges(self, ids: Sequence[str]) -> list[tuple[str, list]]:
        """(id, entries) for each id, in order; entries is empty for an id the stream lacks.

        A claim is mostly a run of consecutive entries, so each stream's ids are read
        sorted, ``_CHUNK`` at a time, with one ``XRANGE first last COUNT n`` each
        (pipelined): one reply of n entries parses ~10x faster than n replies. Ids such
        a range does not return (entries of other consumers in between cut it short,
        or the entry is gone) are then read one by one.
        """
        wanted = set(ids)
        found: dict[str, list] = {}
        by_stream: dict[str, list[str]] = {}
        for m in wanted:
            s, entry = _split_id(m)
            by_stream.setdefault(s, []).append(entry)
        pipe = self.r.pipeline(transaction=False)
        asked: list[str] = []
        for s, entries in by_stream.items():
            entries.sort(key=_entry_key)
            for i in range(0, len(entries), _CHUNK):
                chunk = entries[i : i + _CHUNK]
                pipe.xrange(s, chunk[0], chunk[-1], count=len(chunk))
                asked.append(s)
        for s, got in zip(asked, self._call("XRANGE", pipe.execute), strict=True):
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
            s, entry = _split_id(m)
            by_stream.setdefault(s, []).append(entry)
        pipe = self.r.pipeline(transaction=False)
        for s, entries in by_stream.items():
            for i in range(0, len(entries), _CHUNK):
                pipe.xack(s, self.cfg.group, *entries[i : i + _CHUNK])
        self._call("XACK", pipe.execute)

    # --- executor call -------------------------------------------------------------

    def fetch(self, ids: Sequence[str], arrow_schema) -> Iterator[Any]:
        import pyarrow as pa

        payload = list(arrow_schema)[2:]
        bad_type = payload.pop().type if self.cfg.bad_message_column is not None else None
        build = self._payload_builder(payload)
        for i in range(0, len(ids), _FETCH_ROWS):
            got = self._ranges(ids[i : i + _FETCH_ROWS])
            gone = [m for m, entries in got if not entries]
            if gone:
                raise SourceError(
                    f"{FORMAT}: {len(gone)} claimed messages no longer exist at "
                    f"{_safe_url(self.cfg.url)} (deleted or trimmed before their batch was "
                    f"read), e.g. {gone[:5]}: a replay cannot read them again; keep "
                    "unacknowledged entries in the stream (trim only acknowledged ones)"
                )
            streams, entry_ids = [], []
            for m, _ in got:
                s, entry = _split_id(m)
                streams.append(s)
                entry_ids.append(entry)
            cols = [pa.array(streams, pa.string()), pa.array(entry_ids, pa.string())]
            payload_cols, bad = build(got)
            cols.extend(payload_cols)
            if bad:
                self._bad_messages(got, bad)
            if bad_type is not None:
                cols.append(_bad_message_column(got, bad, bad_type))
            yield pa.RecordBatch.from_arrays(cols, schema=arrow_schema)

    def _payload_builder(self, payload: list) -> Callable[[Sequence[tuple[str, list]]], Any]:
        """From fetched entries to (payload columns, {row: why it is a bad message})."""
        if self.cfg.payload_format != "json":

            def fields(got: Sequence[tuple[str, list]]) -> tuple[list[Any], dict[int, str]]:
                column, bad = _fields_map(got, payload[0].type)
                return [column], bad

            return fields
        convert = _row_converter(payload, self.cfg.required_columns)
        json_field = self.cfg.json_field

        def build(got: Sequence[tuple[str, list]]) -> tuple[list[Any], dict[int, str]]:
            rows: list[list[Any] | None] = []
            bad: dict[int, str] = {}
            for k, (m, entries) in enumerate(got):
                try:
                    rows.append(convert(m, _json_document(m, entries[0][1], json_field)))
                except BadMessageError as e:
                    bad[k] = e.reason
                    rows.append(None)
            return _json_columns(rows, payload, bad), bad

        return build

    def _bad_messages(self, got: Sequence[tuple[str, list]], bad: Mapping[int, str]) -> None:
        """badMessages=fail: the first bad message fails the batch; column: a log line."""
        first = min(bad)
        m, why = got[first][0], bad[first]
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
            len(got),
            self.cfg.bad_message_column,
            m,
            why,
        )


class BadMessageError(SourceError):
    """A claimed message that cannot become a row: ``reason`` says why, without its id."""

    def __init__(self, message_id: str, reason: str) -> None:
        super().__init__(f"{FORMAT}: message {message_id}: {reason}")
        self.message_id = message_id
        self.reason = reason

    def __reduce__(self) -> Any:
        return (type(self), (self.message_id, self.reason))


def _shown(raw: bytes) -> str:
    """Bytes that are not UTF-8 text, for messages."""
    return repr(raw[:40]) + ("..." if len(raw) > 40 else "")


def _not_text(raw: Mapping[bytes, bytes], values: bool) -> str | None:
    """Why the entry's field names (and ``values``) are not all UTF-8 text; None if they are."""
    for name, value in raw.items():
        try:
            text = name.decode()
        except UnicodeDecodeError as e:
            return f"a field name is not UTF-8 text: {_shown(name)} ({e})"
        if values:
            try:
                value.decode()
            except UnicodeDecodeError as e:
                return f"field {text!r} is not UTF-8 text ({e})"
    return None


def _fields_map(got: Sequence[tuple[str, list]], map_type: Any) -> tuple[Any, dict[int, str]]:
    """The ``fields`` column (``map<string,string>``, or ``map<string,binary>`` whose values
    stay bytes) and the bad messages: entries with a name (or, for strings, a value) that
    is not UTF-8, null in the column. Built from flat key/value arrays: Arrow checks the
    UTF-8 of all of them at once (per-message decoding costs ~3x more)."""
    import pyarrow as pa

    text = pa.types.is_string(map_type.item_type)

    def build(skip: Mapping[int, str]) -> Any:
        offsets, keys, values = [0], [], []
        for k, (_, entries) in enumerate(got):
            if k not in skip:
                raw = entries[0][1]
                keys.extend(raw.keys())
                values.extend(raw.values())
            offsets.append(len(keys))
        items = pa.array(values, pa.binary())
        return pa.MapArray.from_arrays(
            pa.array(offsets, pa.int32()),
            pa.array(keys, pa.binary()).cast(pa.string()),
            items.cast(pa.string()) if text else items,
            type=map_type,
            mask=pa.array([k in skip for k in range(len(got))]) if skip else None,
        )

    try:
        return build({}), {}
    except pa.ArrowInvalid:
        pass  # some message is not UTF-8: find which, and leave them out
    bad = {}
    for k, (_, entries) in enumerate(got):
        why = _not_text(entries[0][1], text)
        if why is not None:
            bad[k] = why
    return build(bad), bad


def _json_document(message_id: str, raw: Mapping[bytes, bytes], name: str) -> Any:
    """The JSON object in field ``name`` of an entry; only that field has to be UTF-8."""
    value = raw.get(name.encode())
    if value is None:
        shown = sorted(k.decode(errors="backslashreplace") for k in raw)[:10]
        raise BadMessageError(
            message_id, f"no field {name!r} (jsonField) to parse; its fields: {shown}"
        )
    try:
        text = value.decode()
    except UnicodeDecodeError as e:
        raise BadMessageError(message_id, f"field {name!r} is not UTF-8 text ({e})") from None
    try:
        doc = json.loads(text, parse_float=decimal.Decimal)  # decimals stay exact
    except ValueError as e:
        raise BadMessageError(message_id, f"field {name!r} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadMessageError(
            message_id,
            f"field {name!r} holds a JSON {type(doc).__name__}, expected an object",
        )
    return doc


def _json_columns(rows: list, payload: list, bad: dict[int, str]) -> list[Any]:
    """The payload columns of converted rows (None: a bad message, null everywhere).

    A value Arrow refuses (a decimal with more digits than its column has) is found
    message by message and makes that message a bad one in ``bad``, in place.
    """
    import pyarrow as pa

    errors = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
    while True:
        try:
            return [
                pa.array([None if r is None else r[j] for r in rows], type=f.type)
                for j, f in enumerate(payload)
            ]
        except errors as e:
            failed = e
        found = False
        for j, f in enumerate(payload):
            for k, row in enumerate(rows):
                if row is None:
                    continue
                try:
                    pa.array([row[j]], type=f.type)
                except errors as e:
                    bad[k] = f"{f.name} ({f.type}): {e}"
                    rows[k] = None
                    found = True
        if not found:  # no single value fails: not a message's fault
            raise SourceError(f"{FORMAT}: building the payload columns: {failed}") from failed


def _bad_message_column(
    got: Sequence[tuple[str, list]], bad: Mapping[int, str], bad_type: Any
) -> Any:
    """badMessageColumn: null for rows that were read, else why not and the entry's fields
    as they are in Redis (bytes: whatever the producer wrote survives)."""
    import pyarrow as pa

    if not bad:
        return pa.nulls(len(got), bad_type)
    values: list[dict[str, Any] | None] = [None] * len(got)
    for k, why in bad.items():
        values[k] = {"error": why, "fields": list(got[k][1][0][1].items())}
    return pa.array(values, type=bad_type)


# --- JSON values to Arrow values, by the declared type ---------------------------------------


class _BadValue(Exception):
    pass


def _show(v: Any) -> str:
    """A JSON value as its text, for messages (numbers are parsed as exact decimals)."""
    return json.dumps(v, default=str)[:60]


def _converter(t, where: str) -> Callable[[Any], Any]:
    """A function from a JSON value to what ``pa.array(..., type=t)`` accepts; strict."""
    import pyarrow as pa

    def need(kinds: tuple[type, ...], what: str) -> Callable[[Any], Any]:
        def conv(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
                raise _BadValue(f"{where}: expected {what}, got {_show(v)}")
            return v

        return conv

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return lambda v: v if v is None or isinstance(v, str) else json.dumps(v, default=float)
    if pa.types.is_boolean(t):
        return need((bool,), "true or false")
    if pa.types.is_integer(t):
        integer = need((int,), "an integer")
        low, high = -(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1)  # Spark's are signed

        def bounded(v: Any) -> Any:
            if integer(v) is not None and not low <= v < high:
                raise _BadValue(f"{where}: {v} is out of range for {t}")
            return v

        return bounded
    if pa.types.is_floating(t):
        number = need((int, float, decimal.Decimal), "a number")
        return lambda v: None if v is None else float(number(v))
    if pa.types.is_decimal(t):

        def dec(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float, str, decimal.Decimal)):
                raise _BadValue(f"{where}: expected a decimal number, got {_show(v)}")
            try:
                return decimal.Decimal(str(v))
            except decimal.InvalidOperation:
                raise _BadValue(f"{where}: {v!r} is not a decimal number") from None

        return dec
    if pa.types.is_date(t):

        def date(v: Any) -> Any:
            if v is None:
                return None
            try:
                return dt.date.fromisoformat(v)
            except (TypeError, ValueError):
                raise _BadValue(f"{where}: expected an ISO date, got {_show(v)}") from None

        return date
    if pa.types.is_timestamp(t):
        aware = t.tz is not None

        def ts(v: Any) -> Any:
            if v is None:
                return None
            try:
                d = dt.datetime.fromisoformat(v[:-1] + "+00:00" if v.endswith("Z") else v)
            except (TypeError, ValueError, AttributeError):
                raise _BadValue(f"{where}: expected an ISO timestamp, got {_show(v)}") from None
            if aware and d.tzinfo is None:
                return d.replace(tzinfo=dt.timezone.utc)  # Spark's Arrow path is UTC
            if not aware and d.tzinfo is not None:
                return d.astimezone(dt.timezone.utc).replace(tzinfo=None)
            return d

        return ts
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):

        def b64(v: Any) -> Any:
            if v is None:
                return None
            try:
                return base64.b64decode(v, validate=True)
            except (TypeError, ValueError):
                raise _BadValue(f"{where}: expected base64 text, got {_show(v)}") from None

        return b64
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = _converter(t.value_type, f"{where}[]")

        def lst(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, list):
                raise _BadValue(f"{where}: expected an array, got {_show(v)}")
            return [item(x) for x in v]

        return lst
    if pa.types.is_map(t):
        if not pa.types.is_string(t.key_type):
            raise ConfigError(
                f"{FORMAT}: column {where} is a map with {t.key_type} keys; JSON object keys "
                "are strings: use map<string,...>"
            )
        value = _converter(t.item_type, f"{where}{{}}")

        def mp(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, dict):
                raise _BadValue(f"{where}: expected an object, got {_show(v)}")
            return [(k, value(x)) for k, x in v.items()]

        return mp
    if pa.types.is_struct(t):
        fields = [
            (
                t.field(i).name,
                t.field(i).nullable,
                _converter(t.field(i).type, f"{where}.{t.field(i).name}"),
            )
            for i in range(t.num_fields)
        ]

        def struct(v: Any) -> Any:
            if v is None:
                return None
            if not isinstance(v, dict):
                raise _BadValue(f"{where}: expected an object, got {_show(v)}")
            out = {name: conv(v.get(name)) for name, _, conv in fields}
            for name, nullable, _ in fields:
                if out[name] is None and not nullable:  # the JVM would fail on it instead
                    raise _BadValue(f"{where}.{name} is declared NOT NULL, but has no value")
            return out

        return struct
    raise ConfigError(
        f"{FORMAT}: column {where} has type {t}, which payloadFormat=json cannot fill"
    )


def _row_converter(payload, required: Sequence[str] = ()) -> Callable[[str, dict], list[Any]]:
    """JSON object -> row values; a :class:`BadMessageError` for a value of another type or
    a missing one in a NOT NULL column (``required``: NOT NULL in ``schema``, nullable in
    the reported schema)."""
    must = {name.lower() for name in required}
    convs = [
        (f.name, f.nullable and f.name.lower() not in must, _converter(f.type, f.name))
        for f in payload
    ]

    def convert(message_id: str, doc: dict) -> list[Any]:
        try:
            row = [conv(doc.get(name)) for name, _, conv in convs]
        except _BadValue as e:
            raise BadMessageError(message_id, str(e)) from None
        for (name, nullable, _), value in zip(convs, row, strict=True):
            if value is None and not nullable:  # Arrow would fail deep in the JVM instead
                raise BadMessageError(
                    message_id,
                    f"{name} is declared NOT NULL in option schema, but the message has no "
                    "value for it",
                )
        return row

    return convert


# --- the Spark data source ------------------------------------------------------------------


class TxnRedisDataSource(DataSource):
    """``txn-redis``: Redis Streams consumer group, exactly once through a claim log."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return RedisSourceOptions.parse(self.options).ddl

    def streamReader(self, schema):
        return RedisSourceOptions.parse(self.options).reader(schema)
