"""Operating a sink from outside Spark: find it (``handle``), inspect it (``status``),
repair it (``repair``), check its files (``verify``), name and export its snapshots
(``snapshots``) and export Spark's operator state (``state_export``).

Nothing here needs a SparkSession (a few commands start one when asked to). The sinks
never import this package: a sink serves export requests through the hook it owns
(:mod:`pyspark_txn.sinks.hooks`), which :mod:`pyspark_txn.operations.snapshots` fills in."""
