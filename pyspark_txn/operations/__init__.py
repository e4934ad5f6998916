"""Operating sinks and pipelines from outside Spark: find a sink (``handle``), inspect it
(``status``), repair it (``repair``), check its files (``verify``), name and export its
snapshots (``snapshots``), export Spark's operator state (``state_export``) and take
consistent backups of a whole pipeline of queries (``backups``).

Nothing here needs a SparkSession (a few commands start one when asked to). The sinks
never import this package: a sink serves export requests through the hook it owns
(:mod:`pyspark_txn.sinks.hooks`), which :mod:`pyspark_txn.operations.snapshots` fills in."""
