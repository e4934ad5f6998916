"""Where the record log is stored: ``delta_log`` (the Delta record table). The pure
protocol in :mod:`pyspark_txn.state` never imports these; the sinks, sources and
operations pick one and hand it to :class:`~pyspark_txn.state.RecordStore`."""
