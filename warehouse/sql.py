"""Read-only SQL over the warehouse views, for analysts and `dxr sql`."""

from __future__ import annotations

import base64
import csv
import datetime
import decimal
import difflib
import io
import json
import math
import re
from collections.abc import Callable, Iterator

import duckdb
import pyarrow as pa

from dxr.errors import InputError
from warehouse import duck
from warehouse.runs import unknown_run
from warehouse.schemas import TABLES
from warehouse.store import Warehouse, check_run_id

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_READ_ONLY_PREFIXES = ("select", "with", "from", "describe", "show", "summarize", "pivot", "unpivot", "explain",
                       "values", "table")


# The columns of an EXPLAIN statement's result: a key (physical_plan) and the plan drawn as text.
_EXPLAIN_COLUMNS = ["explain_key", "explain_value"]

# Rows fetched from DuckDB at a time when CSV or JSON lines are streamed.
STREAM_ROWS = 10_000


def run_query(wh: Warehouse, query: str, fmt: str = "table", with_gold: bool = False,
              run_id: str | None = None) -> str:
    """The whole output of `stream_query` as one string (for small results)."""
    return "".join(stream_query(wh, query, fmt=fmt, with_gold=with_gold, run_id=run_id))


def stream_query(wh: Warehouse, query: str, fmt: str = "table", with_gold: bool = False,
                 run_id: str | None = None, params: list | dict | None = None) -> Iterator[str]:
    """Run one read-only statement and yield its result as text: an aligned table, CSV or JSON lines.

    A refused query, or an error in its first `STREAM_ROWS` rows, is raised before the first piece.
    CSV and JSON lines come `STREAM_ROWS` rows at a time, so exporting a table of millions of rows
    holds one batch in memory, not the result; the aligned table needs every row for its widths.
    With `run_id`, the tables partitioned by run show only that run's rows (`Warehouse.connect`). `params` are the
    values of the query's `?` or `$name` placeholders (a command's options, never spliced into its text).
    """
    yield from stream_result(_execute(wh, query, with_gold, run_id, params), fmt)


def table_text(table: pa.Table, fmt: str = "table") -> str:
    """Rows that come from outside the warehouse (MLflow's registered versions) spelt as `dxr sql` spells a result."""
    con = duckdb.connect()
    con.register("result", table)
    return "".join(stream_result(con.execute("SELECT * FROM result"), fmt))


def stream_result(cursor: duckdb.DuckDBPyConnection, fmt: str) -> Iterator[str]:
    """The result of a started query as text (`stream_query`)."""
    columns = [d[0] for d in cursor.description]
    if fmt == "table" and columns == _EXPLAIN_COLUMNS:
        # A plan is a drawing of many lines: a table cell would escape its line breaks into one line.
        yield "".join(f"{plan.rstrip()}\n" for _, plan in _fetch(cursor, None))
        return
    if fmt == "table":
        # Values as their CSV cells: nested ones (a MAP's spelling depends on its key type, which its Python value
        # lacks) and blobs; format_table spells booleans, decimals, intervals and times alike and aligns decimals and
        # intervals as numbers.
        converted = [_csv_converter(d[1]) if d[1].id in (*_NESTED, "union", "blob") else None
                     for d in cursor.description]
        rows = _fetch(cursor, None)
        if any(converted):
            rows = [tuple(f(v) if f else v for f, v in zip(converted, r)) for r in rows]
        yield format_table(columns, rows)
        return
    if fmt == "json":
        keys = unique_names(columns)
        convert = [_json_converter(d[1]) for d in cursor.description]
        # json.dumps spells a Decimal as text: rows holding decimals are written by _json_text instead.
        dumps = _json_text if any(_holds_decimal(d[1]) for d in cursor.description) else (
            lambda value: json.dumps(value, default=_json_default))
        header, text = "", lambda rows: "".join(
            dumps({k: f(v) for k, f, v in zip(keys, convert, r)}) + "\n" for r in rows)
    else:
        convert = [_csv_converter(d[1]) for d in cursor.description]
        header = _csv_text([columns])
        text = (_csv_text if not any(convert) else
                lambda rows: _csv_text([[f(v) if f else v for f, v in zip(convert, r)] for r in rows]))
    batch = _fetch(cursor, STREAM_ROWS)  # before the header: an error in the first rows prints nothing
    yield header
    while batch:
        yield text(batch)
        batch = _fetch(cursor, STREAM_ROWS)


def _csv_text(rows: list) -> str:
    """Rows as CSV lines, NULL as an empty field and an empty string as `""`, as DuckDB's CSV writer spells them:
    the csv module writes both as an empty field, so a row holding an empty string is written field by field.

    >>> _csv_text([("", None, "a,b", 1), ("x", None, "y", 2)]).splitlines()
    ['"",,"a,b",1', 'x,,y,2']
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        if "" in row:
            out.write(",".join('""' if value == "" else _csv_field(value) for value in row) + "\n")
        else:
            writer.writerow(row)
    return out.getvalue()


def _csv_field(value) -> str:
    """One non-empty field as the csv module writes it in a row (quoted when it holds a comma, quote or line break);
    None as an empty field."""
    if value is None:
        return ""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow([value])
    return out.getvalue()[:-1]


def _fetch(cursor: duckdb.DuckDBPyConnection, n: int | None) -> list[tuple]:
    """The next `n` rows (all that are left when None); an error while the query runs on is one line."""
    try:
        return cursor.fetchall() if n is None else cursor.fetchmany(n)
    except duckdb.Error as exc:
        raise InputError(f"SQL error: {_one_line(exc.args[0])}") from exc


def _one_line(message: str) -> str:
    """DuckDB's error message as one line: its first paragraph, whose later lines hold its hint (the columns that
    a misspelt one may mean, the fix for a column missing from GROUP BY), without the echoed query and caret.

    >>> _one_line('Binder Error: Referenced column "config" not found in FROM clause!\\nCandidate bindings: '
    ...           '"config_json"\\n\\nLINE 1: SELECT config FROM runs\\n               ^^^^^^')
    'Binder Error: Referenced column "config" not found in FROM clause! Candidate bindings: "config_json"'
    """
    return " ".join(line.strip() for line in message.strip().split("\n\n")[0].splitlines())


def _execute(wh: Warehouse, query: str, with_gold: bool, run_id: str | None,
             params: list | dict | None) -> duckdb.DuckDBPyConnection:
    """Check that `query` is one read-only statement over the warehouse and start it."""
    head = query.lstrip().split(None, 1)[0].lower() if query.strip() else ""
    if head not in _READ_ONLY_PREFIXES:
        *first, last = (prefix.upper() for prefix in _READ_ONLY_PREFIXES)
        raise InputError(f"dxr sql runs read-only queries; {head or 'an empty query'!r} is not allowed: "
                         f"start with {', '.join(first)} or {last}")
    if run_id is not None and not wh.has_rows("runs", run_id=check_run_id(run_id)):
        raise unknown_run(wh, run_id)
    for attempt in (1, 2):
        con = wh.connect(gold=with_gold, run_id=run_id, tables=named_tables(query))
        if with_gold:  # the gold connection reads everything of the warehouse, and nothing outside it
            duck.confine(con, wh.forecast_dir, wh.gold_dir)
        con.execute("SET lock_configuration=true")
        try:
            # The prefix alone is not enough: `SELECT 1; COPY … TO …` would run the second statement too, and
            # the connection may write inside the forecasting store it reads.
            kinds = [st.type for st in con.extract_statements(query)]
            pivot = head in ("pivot", "unpivot") and kinds == [duckdb.StatementType.MULTI]
            if not pivot and (len(kinds) != 1
                              or kinds[0] not in (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)):
                raise InputError(f"dxr sql runs exactly one read-only query; this text holds {len(kinds)} "
                                 f"statement(s) of kind {', '.join(k.name for k in kinds)}: send a single SELECT")
            if kinds == [duckdb.StatementType.EXPLAIN] and _analyzes(query):
                raise InputError("dxr sql does not run EXPLAIN ANALYZE: it executes the statement it explains "
                                 "(which may write files); use EXPLAIN alone")
            return con.execute(query, params)
        except duckdb.PermissionException as exc:
            if with_gold:
                raise InputError(f"query reads outside the warehouse at {wh.root} "
                                 f"({exc.args[0].splitlines()[0]}): dxr sql reads only warehouse tables") from exc
            raise InputError(f"query reads outside the forecasting store ({exc.args[0].splitlines()[0]}); "
                             "add --with-gold to read gold tables") from exc
        except duckdb.CatalogException as exc:
            raise InputError(_catalog_error(exc.args[0], with_gold)) from exc
        except duckdb.Error as exc:
            # Another process removed a table's last partition after the views were made (a cohort
            # rebuild): the views of a new connection show the tables as they are now. The second attempt
            # returns or raises.
            if attempt == 1 and isinstance(exc, duckdb.IOException) and "No files found" in exc.args[0]:
                continue
            raise InputError(f"SQL error: {_one_line(exc.args[0])}") from exc


def _catalog_error(message: str, with_gold: bool) -> str:
    """DuckDB's unknown-name error on one line, with the tables a misspelt table name may mean.

    DuckDB's own guess (its second line) picks among the views of the connection, which are those of the
    tables the query names (`named_tables`): for `rankingz` or `targets` without --with-gold it has
    none to offer, or a wrong one. Its guess for a function is kept.
    """
    first, *rest = message.splitlines()
    table = re.search(r"Table with name (\S+) does not exist", first)
    if table is None:
        return " ".join([first, *(line for line in rest[:1] if line.startswith("Did you mean"))])
    name = table.group(1).lower()

    def shown(candidate: str) -> str:
        gold = TABLES[candidate].store == "gold" and not with_gold
        return f"{candidate} (a gold table: add --with-gold)" if gold else candidate

    if name in TABLES and TABLES[name].store == "gold" and not with_gold:
        return f"{first} {name} is a gold table: add --with-gold"
    close = difflib.get_close_matches(name, sorted(TABLES), n=2)
    guess = f"Did you mean {' or '.join(shown(c) for c in close)}? " if close else ""
    return f"{first} {guess}(SHOW TABLES lists the tables{'' if with_gold else '; gold ones need --with-gold'})"


def _analyzes(query: str) -> bool:
    """Whether an EXPLAIN statement asks for ANALYZE (in any spelling or position, e.g. `EXPLAIN (ANALYZE) …`).

    Read from DuckDB's own tokens, so a comment or a string holding the word does not count.
    """
    words = (query[start:].split(None, 1)[0].strip("(),").lower() for start, kind in duckdb.tokenize(query)
             if kind in (duckdb.token_type.keyword, duckdb.token_type.identifier))
    return any(word in ("analyze", "analyse") for word in words)


def unique_names(columns: list[str]) -> list[str]:
    """Column names as JSON keys: a repeated name (`SELECT r.code, s.code`) gets `_1`, `_2`, … (a suffix no
    other column has).

    >>> unique_names(["code", "code", "n", "code", "code_1"])
    ['code', 'code_2', 'n', 'code_3', 'code_1']
    """
    names: list[str] = []
    for name in columns:
        unique, count = name, 0
        while unique in names or (unique != name and unique in columns):
            count += 1
            unique = f"{name}_{count}"
        names.append(unique)
    return names


# Map key types that DuckDB's Python client cannot make dict keys of: it returns {'key': [...], 'value': [...]}.
_LISTED_KEYS = {"list", "array", "struct", "map"}
# Types whose CSV cell (and aligned-table cell) is JSON text.
_NESTED = ("struct", "list", "array", "map")


def _json_converter(kind: duckdb.DuckDBPyType) -> Callable:
    """A function from a value of DuckDB type `kind`, as the Python client returns it, to plain JSON data.

    A STRUCT is an object; a LIST or ARRAY an array; a MAP with VARCHAR or ENUM keys an object, a MAP with other
    keys (numbers, dates, lists, ...) an array of {"key": ..., "value": ...} objects, since JSON keys are
    strings only; a BLOB the base64 of its bytes; an INTERVAL its length in seconds (a number; DuckDB's client
    counts a month as 30 days); NaN and infinities null (JSON has no spelling for them). Every other value is
    left for json.dumps(default=str): dates and timestamps as ISO text, UUIDs as text; a DECIMAL stays a Decimal,
    which `_json_text` writes as a JSON number.

    >>> convert = _json_converter(duckdb.sql("SELECT MAP {1: {'b': 'ab'::BLOB}} AS m").description[0][1])
    >>> convert({1: {"b": b"ab"}})
    [{'key': 1, 'value': {'b': 'YWI='}}]
    """
    node = kind.id
    if node == "struct":
        fields = [(name, _json_converter(child)) for name, child in kind.children]
        return lambda v: None if v is None else {name: f(v[name]) for name, f in fields}
    if node in ("list", "array"):
        item = _json_converter(kind.children[0][1])
        return lambda v: None if v is None else [item(x) for x in v]
    if node == "map":
        (_, key_kind), (_, value_kind) = kind.children
        key, value = _json_converter(key_kind), _json_converter(value_kind)
        listed = key_kind.id in _LISTED_KEYS
        pairs = (lambda v: zip(v["key"], v["value"])) if listed else (lambda v: v.items())
        if key_kind.id in ("varchar", "enum"):
            return lambda v: None if v is None else {k: value(x) for k, x in pairs(v)}
        return lambda v: None if v is None else [{"key": key(k), "value": value(x)} for k, x in pairs(v)]
    # A UNION's value comes without the name of its member, so it is converted by its Python type.
    if node in ("union", "blob", "interval", "double", "float"):
        return _json_plain
    return _same


def _same(value):
    return value


def _time_text(value: datetime.datetime | datetime.time) -> str:
    """A timestamp or a time as SQL and DuckDB spell it (a space before the time), in ISO-8601 form otherwise: the
    fractional seconds without trailing zeros (none when whole), an offset as +HH:MM.

    >>> _time_text(datetime.datetime(2026, 12, 5, 9, 25, 19, 500000))
    '2026-12-05 09:25:19.5'
    >>> _time_text(datetime.datetime(2026, 12, 5, 9, 25, 19, 120, tzinfo=datetime.timezone.utc))
    '2026-12-05 09:25:19.00012+00:00'
    >>> _time_text(datetime.time(9, 25))
    '09:25:00'
    """
    if isinstance(value, datetime.datetime):
        text, seconds_end = value.isoformat(sep=" ", timespec="seconds"), len("2026-12-05 09:25:19")
    else:
        text, seconds_end = value.isoformat(timespec="seconds"), len("09:25:19")
    if not value.microsecond:
        return text
    return text[:seconds_end] + f".{value.microsecond:06d}".rstrip("0") + text[seconds_end:]


def _interval_seconds(value: datetime.timedelta) -> decimal.Decimal:
    """An interval's length in seconds, exact to the microsecond and without trailing zeros (spell it with
    format(…, "f"): a whole number of tens is kept as an exponent).

    >>> [format(_interval_seconds(datetime.timedelta(seconds=s)), "f") for s in (25.5, 86_400, -0.5, 0.000001)]
    ['25.5', '86400', '-0.5', '0.000001']
    """
    whole = decimal.Decimal(value.days * 86_400 + value.seconds)
    return (whole + decimal.Decimal(value.microseconds).scaleb(-6)).normalize()


def _json_default(value) -> str:
    """The text of a value JSON has no type for (json.dumps's `default`): times as `_time_text` spells them, UUIDs,
    dates and the rest as str() does."""
    if isinstance(value, (datetime.datetime, datetime.time)):
        return _time_text(value)
    return str(value)


def _json_plain(value):
    """A value of a type unknown here as JSON data: a dict as an object (its keys as text), a tuple or list as an
    array, bytes, timedeltas and non-finite floats as `_json_converter` says."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {str(k): _json_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_plain(v) for v in value]
    return value


def _holds_decimal(kind: duckdb.DuckDBPyType) -> bool:
    """Whether a value of DuckDB type `kind` may hold a DECIMAL (itself, or a field, item or member of it)."""
    if kind.id == "decimal":
        return True
    if kind.id in ("list", "array"):  # an ARRAY's second child is its size, a number
        return _holds_decimal(kind.children[0][1])
    return kind.id in ("struct", "map", "union") and any(_holds_decimal(child) for _, child in kind.children)


def _json_text(value) -> str:
    """`value` (as `_json_converter` makes it) as json.dumps(default=_json_default) spells it, but a Decimal as a
    JSON number with its exact digits (DECIMAL(18,3) 1.250 as 1.250, 1E-7 as 0.0000001, as DuckDB prints them), not
    as text and not rounded through a float.

    >>> _json_text({"a": decimal.Decimal("1.250"), "b": [decimal.Decimal("1E-7"), None], "c": "x"})
    '{"a": 1.250, "b": [0.0000001, null], "c": "x"}'
    """
    if isinstance(value, decimal.Decimal):
        return format(value, "f")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_json_text(v) for v in value) + "]"
    return json.dumps(value, default=_json_default)


def _csv_scalar(value):
    """A cell as DuckDB's CSV writer spells it where Python's text differs: a boolean as true / false, a Decimal
    in fixed-point digits (0.0000001, not 1E-7), a time without trailing zeros (`_time_text`); an interval as its
    seconds without trailing zeros (`_interval_seconds`: 25.5, 93600)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, decimal.Decimal):
        return format(value, "f")
    if isinstance(value, datetime.timedelta):
        return format(_interval_seconds(value), "f")
    if isinstance(value, (datetime.datetime, datetime.time)):
        return _time_text(value)
    return _json_plain(value)


def _csv_converter(kind: duckdb.DuckDBPyType) -> Callable | None:
    """How a CSV cell spells a value of DuckDB type `kind`, or None for the csv module's own text (numbers,
    strings and dates): a nested value is its JSON text, a BLOB its base64, as `_json_converter` says; a BOOLEAN,
    a DECIMAL, an INTERVAL, a time and a timestamp as `_csv_scalar` says."""
    if kind.id in _NESTED:
        convert = _json_converter(kind)
        return lambda v: None if v is None else _json_text(convert(v))
    if kind.id == "union":  # the member's value: JSON text when it is nested, as it is otherwise
        return lambda v: _json_text(_json_plain(v)) if isinstance(v, (dict, list, tuple)) else _csv_scalar(v)
    if kind.id in ("blob", "interval", "boolean", "decimal") or kind.id.startswith(("timestamp", "time")):
        return _csv_scalar
    return None


def named_tables(query: str) -> set[str] | None:
    """The warehouse tables a query's text names, or None (every table) when it names none.

    A view's creation opens every file of its table (about 1.4 s for a registry of 10,000 runs,
    `benchmarks/registry.py`); a query about cohorts should not pay for the runs. Any word equal to a table's
    name counts (a column or an alias of that name only adds a view), and a query that names no table,
    such as `SHOW TABLES` or one over `information_schema`, sees them all.
    """
    named = {word.lower() for word in _WORD.findall(query)} & TABLES.keys()
    return named or None


# A line break or tab inside a text cell would break the table's rows and columns: DuckDB's own table escapes them.
_CELL_ESCAPES = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})


def format_table(columns: list[str], rows: list[tuple]) -> str:
    """A plain aligned text table: numbers right-aligned, floats with 4 decimals, a DECIMAL with its exact digits in
    fixed point, booleans as true / false, intervals as seconds and times as CSV cells spell them (`_csv_scalar`),
    structs, lists and maps as JSON text, NULL as NULL (an empty string stays empty), line breaks and tabs in text
    as \\n, \\r and \\t, as DuckDB's table shows them (one line per row)."""
    def cell(v):
        if v is None:
            return "NULL"
        if isinstance(v, float):
            return f"{v:.4f}"
        if isinstance(v, (bool, decimal.Decimal, datetime.timedelta, datetime.datetime, datetime.time)):
            return _csv_scalar(v)
        if isinstance(v, (dict, list, tuple)):
            return _json_text(_json_plain(v))
        return str(v).translate(_CELL_ESCAPES)

    def number(v) -> bool:
        return isinstance(v, (int, float, decimal.Decimal, datetime.timedelta)) and not isinstance(v, bool)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [bool(rows) and all(number(r[i]) or r[i] is None for r in rows) for i in range(len(columns))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells]
    return "\n".join(out) + f"\n({len(rows)} row{'s' if len(rows) != 1 else ''})\n"
