"""``txn-redis``'s options: parsed and checked before anything touches Redis (a bad one is
a ConfigError naming the option and what is allowed)."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..faults import FaultPlan
from ..spark.options import parse_choice, parse_storage_options, reject_unknown_options
from .acknowledging import (
    AcknowledgingStreamReader,
    BrokerConfig,
    ClaimLogConfig,
)
from .redis_broker import _PASSWORD_PARAM, RedisBroker, _safe_url
from .redis_rows import FORMAT, _converter

log = logging.getLogger(__name__)


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
