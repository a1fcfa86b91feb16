"""Input rows -> generation requests, or an error row saying why a row cannot run.

A row gives its prompt as `prompt` (string) or `messages` (list of {role, content}, chat
template applied), or through the job's `template` over other columns (`{question}`).
Optional columns: `id` (generated from file and row when absent), `domain`, and per-row
sampling overrides (OVERRIDES, and `stop`: a string or a list of strings). A bad row never
stops the others: it becomes (id, error_type, message)."""
from __future__ import annotations

import math
import string
from collections.abc import Callable

import pyarrow as pa

from batchspec.contract import Request, RequestError
from batchspec.jobs.shards import Shard, read_shard
from batchspec.sampling import SamplingParams

FLOAT_OVERRIDES = ("temperature", "top_p")
INT_OVERRIDES = ("top_k", "max_tokens", "seed")
OVERRIDES = FLOAT_OVERRIDES + INT_OVERRIDES
# Columns of the rows of request files (jobs/openai_batch.py): a line's number, and why it
# cannot run when it cannot.
LINE_COLUMNS = ("_line", "_error_type", "_error")


class RowError(Exception):
    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


def template_fields(template: str) -> list[str]:
    """Column names a template refers to ('{doc.title}' -> 'doc')."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        name = field.split(".", 1)[0].split("[", 1)[0]
        if not name or name.isdigit():
            raise ValueError(f"template field {{{field}}} must name a column")
        names.append(name)
    return names


def used_columns(names: list[str], template: str | None) -> list[str]:
    """The columns a row's request is made of; others are never read."""
    wanted = {"id", "domain", "stop", *OVERRIDES, *LINE_COLUMNS}
    wanted |= set(template_fields(template)) if template is not None else {"prompt", "messages"}
    return [n for n in dict.fromkeys(names) if n in wanted]


def check_columns(path: str, schema: pa.Schema, template: str | None) -> None:
    """Fail fast, before any row runs, when a file cannot give prompts at all, or names a
    column it uses twice."""
    names = set(schema.names)
    twice = [n for n in used_columns(schema.names, template) if schema.names.count(n) > 1]
    if twice:
        raise ValueError(f"input {path!r} has more than one column named {twice[0]!r}: "
                         f"rename or drop the extra one(s)")
    if template is not None:
        missing = [f for f in template_fields(template) if f not in names]
        if missing:
            raise ValueError(f"input {path!r} lacks the column(s) {missing} used by the "
                             f"template (columns: {sorted(names)})")
    elif not names & {"prompt", "messages"}:
        raise ValueError(f"input {path!r} has neither a 'prompt' nor a 'messages' column "
                         f"(columns: {sorted(names)}); add one or give a --template")


def _override(name: str, value):
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RowError("invalid_override", f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise RowError("invalid_override", f"{name} must be finite, got {value!r}")
    if name in INT_OVERRIDES:
        if value != int(value):
            raise RowError("invalid_override", f"{name} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _stop(value) -> list[str]:
    """The `stop` override: a string or a list of non-empty strings."""
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RowError("invalid_override", f"stop must be a string or a list of non-empty "
                                           f"strings, got {value!r}")
    return stop


def _prompt(row: dict, template: str | None, chat: bool):
    """The row's prompt as a string or a list of chat messages."""
    if template is not None:
        for name in template_fields(template):
            if row.get(name) is None:
                raise RowError("missing_field", f"column {name!r} is null")
        try:
            prompt = template.format_map(row)
        except (KeyError, AttributeError, IndexError, ValueError) as e:
            raise RowError("template_error", f"template cannot format this row: {e}") from e
    elif row.get("prompt") is not None:
        prompt = row["prompt"]
        if not isinstance(prompt, str):
            raise RowError("invalid_prompt", f"prompt must be a string, got {type(prompt).__name__}")
    elif row.get("messages") is not None:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise RowError("invalid_prompt",
                           "messages must be a list of {role: string, content: string}")
        if not messages:
            raise RowError("empty_prompt", "messages is empty")
        return messages
    else:
        raise RowError("missing_prompt", "row has no prompt (prompt and messages are null)")
    if not prompt.strip():
        raise RowError("empty_prompt", "prompt is empty")
    return [{"role": "user", "content": prompt}] if chat else prompt


def read_rows(table: pa.Table, template: str | None) -> tuple[list[dict], dict[int, str]]:
    """The used columns of a shard's table as one dict per row, converted column by column:
    a value Python cannot hold (a timestamp past year 9999, ...) fails only its own row.
    Returns (rows, {row index: why it could not be read})."""
    rows: list[dict] = [{} for _ in range(len(table))]
    unreadable: dict[int, str] = {}
    for name in used_columns(table.column_names, template):
        column = table.column(name)
        try:
            values = column.to_pylist()
        except (ValueError, OverflowError, ArithmeticError, pa.ArrowException):
            values = []
            for i in range(len(column)):
                try:
                    values.append(column[i].as_py())
                except (ValueError, OverflowError, ArithmeticError, pa.ArrowException) as e:
                    values.append(None)
                    unreadable.setdefault(i, f"column {name!r}: {e}")
        for row, value in zip(rows, values, strict=True):
            row[name] = value
    return rows, unreadable


def row_id(value, shard: Shard, i: int) -> str:
    """The id of row i of a shard: its `id` value, or SOURCE:ROW when that is null/empty."""
    if value is None or (isinstance(value, str) and not value):
        return f"{shard.source}:{shard.start + i}"
    return str(value)


def _row_id(row: dict, shard: Shard, i: int) -> str:
    return row_id(row.get("id"), shard, i)


def row_ids(table: pa.Table, shard: Shard) -> list[str]:
    ids = table.column("id").to_pylist() if "id" in table.column_names else [None] * len(table)
    return [row_id(v, shard, i) for i, v in enumerate(ids)]


def shard_row_ids(shard: Shard) -> list[str]:
    """A shard's row ids for its error rows, even when the shard cannot be read: its id
    column if that reads, else SOURCE:ROW ids."""
    try:
        table = read_shard(shard, columns=["id"])
        if "id" in table.column_names and len(table) == shard.num_rows:
            return row_ids(table, shard)
    except Exception:  # noqa: BLE001 - any read failure: the plan still knows the rows
        pass
    return [row_id(None, shard, i) for i in range(shard.num_rows)]


def prepare_requests(table: pa.Table, shard: Shard, *, sampling: dict,
                     make_request: Callable[..., Request], template: str | None = None,
                     chat: bool = False) -> tuple[list[Request], list[dict]]:
    """(requests that can run, error rows {id, error_type, message}) of one shard's table.
    `sampling` holds the job's SamplingParams fields; a row's non-null overrides win.
    make_request(prompt, params, request_id, domain) is LLM.make_request: it encodes and
    checks the prompt. A row without a seed gets the engine's request_seed(job seed, id)."""
    requests: list[Request] = []
    errors: list[dict] = []
    seen: set[str] = set()
    duplicates = set(shard.duplicate_rows)
    rows, unreadable = read_rows(table, template)
    for i, row in enumerate(rows):
        rid = _row_id(row, shard, i)
        try:
            if row.get("_error_type"):  # a line of a request file that cannot run
                raise RowError(row["_error_type"], row.get("_error") or "invalid request")
            if rid in seen or i in duplicates:
                raise RowError("duplicate_id", f"id {rid!r} appears more than once in the job "
                                               f"(only the first row with it is run, or "
                                               f"reported if it cannot run)")
            seen.add(rid)
            if i in unreadable:
                raise RowError("unreadable_value", unreadable[i])
            fields = dict(sampling)
            for name in OVERRIDES:
                if row.get(name) is not None:
                    fields[name] = _override(name, row[name])
            if row.get("stop") is not None:
                fields["stop"] = _stop(row["stop"])
            try:
                params = SamplingParams(**fields)
            except ValueError as e:
                raise RowError("invalid_override", str(e)) from e
            domain = row.get("domain")
            if domain is not None and not isinstance(domain, str):
                raise RowError("invalid_domain", f"domain must be a string, got {domain!r}")
            prompt = _prompt(row, template, chat)
            try:
                requests.append(make_request(prompt, params, rid, domain))
            except RequestError as e:
                raise RowError(e.kind, str(e)) from e
        except RowError as e:
            message = str(e)
            if row.get("_line") is not None and not message.startswith("line "):
                message = f"line {row['_line']}: {message}"      # (a request file's row)
            errors.append({"id": rid, "error_type": e.error_type, "message": message})
    return requests, errors
