"""``txn-redis``: Redis Streams consumer groups as an exactly-once Spark source.

The generic part (offsets are claim numbers, claims written safely before
the offset is returned, replays read the claimed ids, acks only for committed
batches, dedup of redeliveries) is :mod:`.acknowledging`; this module holds
only the Redis calls:

- claim: ``XREADGROUP GROUP <group> <consumer> COUNT n STREAMS <s> >``, one
  stream after the other (rotating) until the batch's budget is spent; with
  ``blockMs`` a last blocking read over every stream when nothing was there;
- fetch by id (executors): ``XRANGE <s> <first> <last>`` over runs of claimed ids,
  pipelined; a batch planned by the process that claimed it instead ships the entries
  the claim received in its read tasks (entries never change: the same rows);
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

Modules: ``redis_options`` (the options, checked before Redis is touched),
``redis_broker`` (the Redis calls), ``redis_rows`` (messages to rows); the claim protocol
is :mod:`.acknowledging`."""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql.datasource import DataSource

from .acknowledging import (
    ack_committed,
)
from .redis_options import RedisSourceOptions
from .redis_rows import FORMAT


def ack_committed_offset(options: Mapping[str, str], end: Mapping | str) -> int:
    """For sinks: acknowledge the claims of a committed batch, given the reader's options."""
    opts = RedisSourceOptions.parse(options)
    return ack_committed(opts, opts.claim_log, end)


class TxnRedisDataSource(DataSource):
    """``txn-redis``: Redis Streams consumer group, exactly once through a claim log."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return RedisSourceOptions.parse(self.options).ddl

    def streamReader(self, schema):
        return RedisSourceOptions.parse(self.options).reader(schema)


__all__ = ["FORMAT", "RedisSourceOptions", "TxnRedisDataSource", "ack_committed_offset"]
