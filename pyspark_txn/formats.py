"""The Spark data source classes that ``register`` installs."""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from .errors import ConfigError
from .sources.redis import TxnRedisDataSource
from .storage import store_errors


class TxnDeltaDataSource(DataSource):
    """``txn-delta``: two-phase transactional Delta sink (appends, upserts, complete mode) and
    a source of a table's appends or its change data feed."""

    @classmethod
    def name(cls) -> str:
        return "txn-delta"

    def schema(self):
        from .sources.delta import DeltaSourceOptions

        with store_errors():
            return DeltaSourceOptions.parse(self.options).spark_schema_ddl()

    def streamWriter(self, schema, overwrite: bool):
        from .sinks.delta import DeltaSinkOptions, TxnDeltaStreamWriter

        with store_errors():
            opts = DeltaSinkOptions.parse(self.options)
            if overwrite:  # outputMode("complete"): each batch is the whole result
                opts = opts.for_complete_mode()
            return TxnDeltaStreamWriter(opts.with_checkpoint_sink_id(), schema)

    def streamReader(self, schema):
        from .sources.delta import DeltaSourceOptions, DeltaStreamReader

        with store_errors():
            return DeltaStreamReader(DeltaSourceOptions.parse(self.options), schema)


class TxnPostgresDataSource(DataSource):
    """``txn-postgres``: two-phase transactional PostgreSQL sink (prepared transactions)."""

    @classmethod
    def name(cls) -> str:
        return "txn-postgres"

    def streamWriter(self, schema, overwrite: bool):
        from .sinks.postgres import PostgresSinkOptions, TxnPostgresStreamWriter

        if overwrite:
            raise ConfigError(
                "txn-postgres sink: outputMode 'complete' is not supported; use 'append' "
                "(or mode=upsert for updates by key)"
            )
        opts = PostgresSinkOptions.parse(self.options).with_checkpoint_sink_id()
        return TxnPostgresStreamWriter(opts, schema)


class TxnSequenceDataSource(DataSource):
    """``txn-sequence``: deterministic replayable generator."""

    @classmethod
    def name(cls) -> str:
        return "txn-sequence"

    def schema(self) -> str:
        from .sources.sequence import SequenceOptions

        return SequenceOptions.parse(self.options).ddl

    def streamReader(self, schema):
        from .sources.sequence import SequenceOptions, SequenceStreamReader

        return SequenceStreamReader(SequenceOptions.parse(self.options))


ALL_FORMATS = (
    TxnDeltaDataSource,
    TxnPostgresDataSource,
    TxnSequenceDataSource,
    TxnRedisDataSource,
)
