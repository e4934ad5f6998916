"""Public entry point of consistent pipeline backups (see :mod:`pyspark_txn.operations.backups`)."""

from pyspark_txn.operations.backups import *  # noqa: F403
from pyspark_txn.operations.backups import __all__  # noqa: F401
