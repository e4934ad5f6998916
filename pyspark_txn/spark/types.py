"""Questions about Spark SQL types that look through nesting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def any_nested_type(dtype: Any, leaf: Callable[[Any], bool]) -> bool:
    """Whether ``leaf`` holds for ``dtype`` or any type nested in it (struct fields,
    array elements, map keys and values, a user-defined type's SQL type)."""
    from pyspark.sql import types as T

    if leaf(dtype):
        return True
    if isinstance(dtype, T.StructType):
        return any(any_nested_type(f.dataType, leaf) for f in dtype.fields)
    if isinstance(dtype, T.ArrayType):
        return any_nested_type(dtype.elementType, leaf)
    if isinstance(dtype, T.MapType):
        return any_nested_type(dtype.keyType, leaf) or any_nested_type(dtype.valueType, leaf)
    if isinstance(dtype, T.UserDefinedType):
        return any_nested_type(dtype.sqlType(), leaf)
    return False
