"""Delta tables as other engines leave them, for the ``txn-delta`` source.

``TABLES`` maps a name to a builder ``build(path) -> Table``; see ``tables.py``.
"""

from .tables import TABLES, Table

__all__ = ["TABLES", "Table"]
