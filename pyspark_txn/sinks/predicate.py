"""A SQL boolean predicate over a row (``deleteWhen``), parsed once into a pyarrow
expression: the sink runs in Python workers without a SparkSession, so it cannot ask
Spark to evaluate it, and the row decides what phase 2 does with it (delete or upsert).

The grammar is the part of Spark SQL a change-record predicate needs: comparisons
(``= == != <> < <= > >=``), ``IS [NOT] NULL``, ``[NOT] IN (...)``, ``[NOT] BETWEEN a AND
b``, ``AND``, ``OR``, ``NOT``, parentheses; string (``'D'``, ``''`` for a quote), number,
``TRUE``/``FALSE``/``NULL`` literals; columns by name (backticks for odd names). Anything
else is refused at parse time naming the position, so a predicate never half-works.
Null follows SQL: a comparison with null is unknown, and an unknown predicate is false
(the row is not a delete)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<number>\d+\.\d*|\.\d+|\d+)
    | (?P<string>'(?:[^']|'')*')
    | (?P<quoted>`(?:[^`]|``)+`)
    | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op><=|>=|<>|!=|==|=|<|>|\(|\)|,)
    )""",
    re.VERBOSE,
)
_KEYWORDS = {"AND", "OR", "NOT", "IS", "NULL", "IN", "BETWEEN", "TRUE", "FALSE"}
_COMPARISONS = {"=", "==", "!=", "<>", "<", "<=", ">", ">="}


@dataclass(frozen=True)
class _Tok:
    kind: str  # number | string | column | keyword | op | end
    value: Any
    at: int


def _tokens(text: str, option: str) -> list[_Tok]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            at = len(text) - len(text[pos:].lstrip())
            raise ConfigError(
                f"option {option}={text!r}: cannot read {text[at:][:20]!r} at position "
                f"{at}; {_SUPPORTED}"
            )
        kind = m.lastgroup
        raw = m.group(kind)  # type: ignore[arg-type]
        at = m.start(kind)  # type: ignore[arg-type]
        if kind == "number":
            out.append(_Tok("number", float(raw) if "." in raw else int(raw), at))
        elif kind == "string":
            out.append(_Tok("string", raw[1:-1].replace("''", "'"), at))
        elif kind == "quoted":
            out.append(_Tok("column", raw[1:-1].replace("``", "`"), at))
        elif kind == "word" and raw.upper() in _KEYWORDS:
            out.append(_Tok("keyword", raw.upper(), at))
        elif kind == "word":
            out.append(_Tok("column", raw, at))
        else:
            out.append(_Tok("op", raw, at))
        pos = m.end()
    out.append(_Tok("end", None, len(text)))
    return out


_SUPPORTED = (
    "supported: comparisons (= != <> < <= > >=), IS [NOT] NULL, [NOT] IN (...), [NOT] "
    "BETWEEN, AND, OR, NOT, parentheses, 'strings', numbers, TRUE/FALSE/NULL and column names"
)


@dataclass(frozen=True)
class Predicate:
    """A parsed predicate: its text (what crosses process boundaries) and its columns."""

    text: str
    columns: tuple[str, ...]

    def expression(self) -> Any:
        """The pyarrow compute expression (rebuilt where it is used: not picklable)."""
        return _Parser(self.text, "deleteWhen").parse()[0]

    def mask(self, table: Any) -> Any:
        """A boolean array: where the predicate is true (unknown counts as false)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.dataset as ds

        values = ds.dataset(table).to_table(columns={"m": self.expression()}).column("m")
        if not pa.types.is_boolean(values.type):
            raise TypeError(f"it gives {values.type} values, not true or false")
        return pc.fill_null(values, False)

    def check_schema(self, schema: Any, option: str = "deleteWhen") -> None:
        """Every column is in ``schema`` and the predicate evaluates on it (types agree):
        refused before any data is touched."""
        missing = [c for c in self.columns if c not in schema.names]
        if missing:
            raise ConfigError(
                f"option {option}={self.text!r}: columns {missing} are not in the stream "
                f"{schema.names}"
            )
        try:
            self.mask(schema.empty_table())
        except Exception as e:  # pyarrow's type errors: name the option, not the engine
            raise ConfigError(
                f"option {option}={self.text!r} cannot be evaluated on the stream's columns "
                f"({type(e).__name__}: {e})"
            ) from None


def parse_predicate(text: str, option: str = "deleteWhen") -> Predicate:
    """Parse ``text`` (refused by name and position when it is not a predicate)."""
    if not text or not text.strip():
        raise ConfigError(f"option {option} is empty: give a predicate such as op = 'D'")
    _, columns = _Parser(text, option).parse()
    return Predicate(text.strip(), tuple(dict.fromkeys(columns)))


class _Parser:
    def __init__(self, text: str, option: str) -> None:
        self.text = text
        self.option = option
        self.toks = _tokens(text, option)
        self.i = 0
        self.columns: list[str] = []

    # --- helpers ---
    def _peek(self) -> _Tok:
        return self.toks[self.i]

    def _next(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def _is(self, kind: str, value: Any = None) -> bool:
        tok = self._peek()
        return tok.kind == kind and (value is None or tok.value == value)

    def _expect(self, kind: str, value: Any, what: str) -> _Tok:
        if not self._is(kind, value):
            self._fail(f"expected {what}")
        return self._next()

    def _fail(self, why: str) -> None:
        tok = self._peek()
        seen = "the end" if tok.kind == "end" else repr(self.text[tok.at :].strip()[:20])
        raise ConfigError(
            f"option {self.option}={self.text!r}: {why} at position {tok.at} (found {seen}); "
            f"{_SUPPORTED}"
        )

    # --- grammar ---
    def parse(self) -> tuple[Any, list[str]]:
        expr = self._or()
        if not self._is("end"):
            self._fail("expected the end of the predicate")
        if isinstance(expr, _Value) and expr.column:
            return expr.expr, self.columns  # a boolean column (its type is checked later)
        if not isinstance(expr, _Bool):
            self.i = 0
            self._fail("not a predicate (a comparison or a boolean column is needed)")
        return expr.expr, self.columns

    def _or(self) -> Any:
        left = self._and()
        while self._is("keyword", "OR"):
            self._next()
            left = _Bool(self._bool(left) | self._bool(self._and()))
        return left

    def _and(self) -> Any:
        left = self._not()
        while self._is("keyword", "AND"):
            self._next()
            left = _Bool(self._bool(left) & self._bool(self._not()))
        return left

    def _not(self) -> Any:
        if self._is("keyword", "NOT"):
            self._next()
            return _Bool(~self._bool(self._not()))
        return self._comparison()

    def _bool(self, value: Any) -> Any:
        if isinstance(value, _Bool):
            return value.expr
        if isinstance(value, _Value) and value.column:
            return value.expr  # a boolean column; pyarrow checks its type
        self._fail("a condition is needed here, not a value")

    def _comparison(self) -> Any:
        import pyarrow.compute as pc

        left = self._primary()
        if isinstance(left, _Bool):
            return left
        tok = self._peek()
        if tok.kind == "op" and tok.value in _COMPARISONS:
            op = self._next().value
            right = self._value(self._primary())
            lhs = self._value(left)
            ops = {
                "=": lambda a, b: a == b,
                "==": lambda a, b: a == b,
                "!=": lambda a, b: a != b,
                "<>": lambda a, b: a != b,
                "<": lambda a, b: a < b,
                "<=": lambda a, b: a <= b,
                ">": lambda a, b: a > b,
                ">=": lambda a, b: a >= b,
            }
            return _Bool(ops[op](lhs, right))
        if self._is("keyword", "IS"):
            self._next()
            negate = self._is("keyword", "NOT") and bool(self._next())
            self._expect("keyword", "NULL", "NULL after IS [NOT]")
            test = self._value(left).is_null()
            return _Bool(~test if negate else test)
        negate = False
        if self._is("keyword", "NOT"):
            self._next()
            negate = True
            if not (self._is("keyword", "IN") or self._is("keyword", "BETWEEN")):
                self._fail("expected IN or BETWEEN after NOT")
        if self._is("keyword", "IN"):
            self._next()
            self._expect("op", "(", "( after IN")
            values = [self._literal()]
            while self._is("op", ","):
                self._next()
                values.append(self._literal())
            self._expect("op", ")", ") closing IN (...)")
            test = pc.is_in(self._value(left), value_set=_array(values))
            if any(v is None for v in values):  # x IN (.., NULL): never false, at most unknown
                import pyarrow as pa

                unknown = pc.scalar(pa.scalar(None, type=pa.bool_()))
                test = pc.if_else(test, pc.scalar(True), unknown)
            return _Bool(~test if negate else test)
        if self._is("keyword", "BETWEEN"):
            self._next()
            low = self._value(self._primary())
            self._expect("keyword", "AND", "AND in BETWEEN .. AND ..")
            high = self._value(self._primary())
            value = self._value(left)
            test = (value >= low) & (value <= high)
            return _Bool(~test if negate else test)
        return left

    def _value(self, value: Any) -> Any:
        if isinstance(value, _Value):
            return value.expr
        self._fail("a value is needed here, not a condition")

    def _literal(self) -> Any:
        tok = self._next()
        if tok.kind in ("number", "string"):
            return tok.value
        if tok.kind == "keyword" and tok.value in ("TRUE", "FALSE"):
            return tok.value == "TRUE"
        if tok.kind == "keyword" and tok.value == "NULL":
            return None
        self.i -= 1
        self._fail("expected a literal")

    def _primary(self) -> Any:
        import pyarrow.compute as pc

        tok = self._peek()
        if tok.kind == "op" and tok.value == "(":
            self._next()
            inner = self._or()
            self._expect("op", ")", ")")
            return inner
        if tok.kind == "column":
            self._next()
            self.columns.append(tok.value)
            return _Value(pc.field(tok.value), column=True)
        if tok.kind in ("number", "string") or (
            tok.kind == "keyword" and tok.value in ("TRUE", "FALSE", "NULL")
        ):
            return _Value(pc.scalar(self._literal()))
        self._fail("expected a column, a literal or (")


@dataclass(frozen=True)
class _Value:
    expr: Any
    column: bool = False


@dataclass(frozen=True)
class _Bool:
    expr: Any


def _array(values: Sequence[Any]) -> Any:
    import pyarrow as pa

    return pa.array([v for v in values if v is not None])
