"""OpenAI Batch files: JSONL requests in, JSONL responses and errors out (docs/openai-batch.md).

Input (`.jsonl`): one request a line, as the OpenAI Batch API takes them,
`{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}`. A line becomes a row of the same shape a Parquet input gives (`id` =
custom_id, `messages` or `prompt`, per-row overrides), so shards, rows and the runner keep
one path. Rows are the file's non-blank lines, in order; a shard is a range of them. A line
that cannot run becomes a row carrying its error (`_error_type`, `_error`), which
jobs/rows.py turns into an error row naming the line: the rest of the file runs.

Body fields used: `messages` (content a string or a list of text parts) or `prompt` (a
string, or a list of one string), `max_tokens` / `max_completion_tokens`, `temperature`,
`top_p`, `seed`, `stop` (a string or a list of strings), `top_k` (vLLM's extension), `n`
(only 1) and `metadata.domain` (the draft's domain). Other fields (`model`,
`frequency_penalty`, `logprobs`, `response_format`, `tools`, ...) are ignored; `model` is
echoed in the response.

Output (`output_format: openai`): when the job finalizes, OUT/openai/output.jsonl gets one
line per answered request and OUT/openai/errors.jsonl one per row that could not run, shard
by shard in plan order (see `write_openai_files`)."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import math

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchspec.jobs.display import draft_name

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
SUFFIXES = (".jsonl",)
BOM = b"\xef\xbb\xbf"     # what some editors write at the start of a UTF-8 file

ROW_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("prompt", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("domain", pa.string()),
    ("temperature", pa.float64()),
    ("top_p", pa.float64()),
    ("top_k", pa.int64()),
    ("max_tokens", pa.int64()),
    ("seed", pa.int64()),
    ("stop", pa.list_(pa.string())),
    ("_line", pa.int64()),           # 1-based line number in the file
    ("_error_type", pa.string()),    # set: the line cannot run (jobs/rows.py)
    ("_error", pa.string()),
])
FLOAT_FIELDS = ("temperature", "top_p")
INT_FIELDS = ("top_k", "seed")


def is_openai_batch(path: str) -> bool:
    return path.lower().endswith(SUFFIXES)


class LineError(ValueError):
    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


def _lines(path: str, offset: int = 0, first_line: int = 1):
    """(line number, text) of the file's non-blank lines, from byte `offset` on (the start
    of line number first_line); a line that is not UTF-8 comes as its bytes (parse_line
    makes it an error row), and a byte-order mark opening the file is dropped."""
    for number, at, raw in _raw_lines(path, offset, first_line):
        if at == 0 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError:
            yield number, raw


def _raw_lines(path: str, offset: int = 0, first_line: int = 1):
    """(line number, byte offset, bytes) of the non-blank lines from `offset` on."""
    with fsspec.open(path, "rb") as f:
        if offset:
            f.seek(offset)
        for number, raw in enumerate(f, first_line):
            if raw.strip():
                yield number, offset, raw
            offset += len(raw)


def row_starts(path: str, every: int) -> tuple[int, list[tuple[int, int]]]:
    """One pass over a request file: (number of rows, [(byte offset, line number)] of rows
    0, every, 2 * every, ...), so that each shard of `every` rows seeks to its first line
    instead of reading the file from the top."""
    starts, n = [], 0
    for number, offset, _ in _raw_lines(path):
        if n % every == 0:
            starts.append((offset, number))
        n += 1
    return n, starts


def count_rows(path: str) -> int:
    return sum(1 for _ in _raw_lines(path))


def _number(body: dict, name: str, integer: bool):
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LineError("invalid_override", f"body.{name} must be a finite number, got {value!r}")
    if not integer:
        return float(value)
    if value != int(value):
        raise LineError("invalid_override", f"body.{name} must be an integer, got {value!r}")
    if not -2**63 <= int(value) < 2**63:
        raise LineError("invalid_override", f"body.{name} must fit in 64 bits, got {value!r}")
    return int(value)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise LineError("invalid_prompt", f"body.messages[{i}].content must be a string or a "
                                      f"list of text parts")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LineError("invalid_prompt", "a chat completion body needs a non-empty "
                                          "'messages' list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LineError("invalid_prompt", f"body.messages[{i}] needs a string 'role'")
        out.append({"role": m["role"], "content": _content(m, i)})
    return out


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise LineError("invalid_prompt", "a completion body needs 'prompt' as a string "
                                          "(or a list of one string)")
    return prompt


def _stop(body: dict) -> list[str] | None:
    """As a list (jobs/rows.py checks the strings)."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise LineError("invalid_override", "body.stop must be a string or a list of strings")
    return stop


def _unicode(value) -> bool:
    """Whether every string in a parsed line is valid Unicode: JSON's escapes can spell half
    a surrogate pair ("\\ud800"), which no UTF-8 file can hold."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_unicode(k) and _unicode(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_unicode(v) for v in value)
    return True


def parse_line(text: str | bytes) -> dict:
    """One request line -> a row of ROW_SCHEMA (without _line); raises LineError."""
    if isinstance(text, bytes):
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LineError("invalid_json", f"not UTF-8 text: {e}") from e
    try:
        line = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError("invalid_json", f"not valid JSON: {e}") from e
    if not _unicode(line):
        raise LineError("invalid_json", "a string in the line is not valid Unicode (an escape "
                                        "of half a surrogate pair, such as \\ud800)")
    if not isinstance(line, dict):
        raise LineError("invalid_request", "a request line must be a JSON object")
    custom_id = line.get("custom_id")
    row: dict = {"id": custom_id if isinstance(custom_id, str) and custom_id else None}
    try:
        if row["id"] is None:
            raise LineError("invalid_request", "custom_id must be a non-empty string")
        if line.get("method", "POST") != "POST":
            raise LineError("invalid_request", f"method must be POST, got {line['method']!r}")
        url, body = line.get("url"), line.get("body")
        if url not in (CHAT_URL, COMPLETIONS_URL):
            raise LineError("unsupported_url", f"url must be {CHAT_URL} or "
                                               f"{COMPLETIONS_URL}, got {url!r}")
        if not isinstance(body, dict):
            raise LineError("invalid_request", "body must be a JSON object")
        if body.get("n", 1) != 1:
            raise LineError("invalid_override", f"body.n must be 1, got {body['n']!r}")
        if url == CHAT_URL:
            row["messages"] = _messages(body)
        else:
            row["prompt"] = _prompt(body)
        for name in FLOAT_FIELDS + INT_FIELDS:
            if body.get(name) is not None:
                row[name] = _number(body, name, name in INT_FIELDS)
        for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
            if body.get(name) is not None:
                row["max_tokens"] = _number(body, name, True)
                break
        row["stop"] = _stop(body)
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise LineError("invalid_request", "body.metadata must be a JSON object")
        domain = (metadata or {}).get("domain")
        if domain is not None and not isinstance(domain, str):
            raise LineError("invalid_domain", "body.metadata.domain must be a string")
        row["domain"] = domain
    except LineError as e:
        return {"id": row["id"], "_error_type": e.error_type, "_error": str(e)}
    except (AttributeError, TypeError) as e:  # e.g. metadata that is not an object
        return {"id": row["id"], "_error_type": "invalid_request", "_error": str(e)}
    return row


def parse_row(number: int, text: str, source: str) -> dict:
    try:
        row = parse_line(text)
    except LineError as e:
        row = {"id": None, "_error_type": e.error_type, "_error": str(e)}
    if row.get("_error"):
        row["_error"] = f"line {number}: {row['_error']}"
    row["id"] = row["id"] or f"{source}:line{number}"
    return row | {"_line": number}


def read_rows(path: str, start: int, num_rows: int, source: str,
              at: tuple[int, int] | None = None) -> pa.Table:
    """Rows start .. start+num_rows (counted over non-blank lines) of a request file; `at`:
    (byte offset, line number) of row `start` (row_starts), read from there."""
    rows = []
    first = 0 if at is None else start
    for i, (number, text) in enumerate(_lines(path, *(at or (0, 1))), first):
        if i >= start + num_rows:
            break
        if i >= start:
            rows.append(parse_row(number, text, source))
    return pa.Table.from_pylist(rows, ROW_SCHEMA)


def iter_column(path: str, name: str):
    """(row, value) of one column of a request file's rows (jobs/shards.py's iter_column)."""
    for i, (number, text) in enumerate(_lines(path)):
        yield i, parse_row(number, text, "").get(name)


def request_index(path: str) -> dict[str, dict]:
    """custom_id -> {line, url, model} of a request file's lines (for the output files)."""
    index: dict[str, dict] = {}
    for number, text in _lines(path):
        try:
            line = json.loads(text)
            custom_id = line.get("custom_id")
            body = line.get("body") if isinstance(line.get("body"), dict) else {}
        except (ValueError, AttributeError):    # (not JSON, not UTF-8, not an object)
            continue
        if isinstance(custom_id, str) and custom_id not in index:
            index[custom_id] = {"line": number, "url": line.get("url"),
                                "model": body.get("model")}
    return index


# ---- output files ---------------------------------------------------------------------------

def _hash_id(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def response_line(out: dict, record: dict | None, request: dict, *, job_id: str,
                  model: str, created: int) -> dict:
    """One line of the output file: the request's answer in the chat.completion (or
    text_completion) shape, with usage, and the acceptance figures under 'batchspec'."""
    key = _hash_id(job_id, out["id"])
    usage = {"prompt_tokens": out["num_prompt_tokens"],
             "completion_tokens": out["num_output_tokens"],
             "total_tokens": out["num_prompt_tokens"] + out["num_output_tokens"]}
    chat = request.get("url", CHAT_URL) == CHAT_URL
    choice = {"index": 0, "logprobs": None, "finish_reason": out["finish_reason"]}
    if chat:
        choice["message"] = {"role": "assistant", "content": out["text"]}
    else:
        choice["text"] = out["text"]
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + key,
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": request.get("model") or model,
            "choices": [choice], "usage": usage}
    record = record or {}
    extension = {"acceptance_rate": record.get("acceptance_rate"),
                 "mean_accepted_length": record.get("mean_accepted_length"),
                 "drafted": record.get("total_drafted"), "accepted": record.get("total_accepted"),
                 "draft": draft_name(out.get("draft")), "domain": out.get("domain"),
                 "fallback": record.get("fallback_triggered"), "job_id": job_id}
    return {"id": "batch_req_" + key, "custom_id": out["id"],
            "response": {"status_code": 200, "request_id": "req_" + key, "body": body},
            "error": None, "batchspec": extension}


def error_line(err: dict, request: dict, *, job_id: str, source_line: int | None,
               from_lines: bool = True) -> dict:
    """One line of the error file: the row that could not run, its reason and line. Its
    custom_id is the row's id when that is a line's custom_id (or a Parquet row's id:
    from_lines False), else null (a line without a usable custom_id, a row of a shard
    that could not be read). Its id is the job's, the row's and the line's: unique in the
    file, and unlike the answer's of a row with the same custom_id."""
    key = _hash_id(job_id, err["id"], "error", str(source_line))
    custom_id = err["id"] if request or not from_lines else None
    return {"id": "batch_req_" + key, "custom_id": custom_id, "response": None,
            "error": {"code": err["error_type"], "message": err["message"],
                      "line": source_line}}


def _read(fs, path: str) -> list[dict]:
    if not fs.exists(path):
        return []
    with fs.open(path, "rb") as f:
        return pq.read_table(f).to_pylist()


def output_paths(root: str) -> dict[str, str]:
    """Where a job in `root` (output dir, path or URL) has its OpenAI Batch files."""
    root = root.rstrip("/")
    return {"output": f"{root}/openai/output.jsonl", "errors": f"{root}/openai/errors.jsonl"}


def write_openai_files(fs, root: str, shards, *, job_id: str, model: str) -> dict:
    """OUT/openai/output.jsonl and OUT/openai/errors.jsonl from the shards' Parquet files,
    shard by shard in plan order (rows in their shard's order). Shards without an outputs
    file (failed, cancelled) contribute their error rows only. Each file is written whole,
    then renamed into place. Returns {"output": path, "errors": path}."""
    from batchspec.jobs.outputs import shard_path, write_atomic
    indexes: dict[str, dict] = {}
    created = int(dt.datetime.now(dt.UTC).timestamp())
    model_name = draft_name(model) or ""
    answers, errors = [], []
    for shard in shards:
        if shard.path not in indexes:
            indexes[shard.path] = (request_index(shard.path) if is_openai_batch(shard.path)
                                   else {})
        index = indexes[shard.path]
        if fs.exists(shard_path(root, "outputs", shard)):
            records = {r["request_id"]: r for r in _read(fs, shard_path(root, "acceptance", shard))}
            for out in _read(fs, shard_path(root, "outputs", shard)):
                answers.append(response_line(out, records.get(out["id"]), index.get(out["id"], {}),
                                             job_id=job_id, model=model_name, created=created))
        for err in _read(fs, shard_path(root, "errors", shard)):
            request = index.get(err["id"], {})
            line = _line_of(err) or request.get("line")   # (a duplicate's own line)
            errors.append(error_line(err, request, job_id=job_id, source_line=line,
                                     from_lines=is_openai_batch(shard.path)))
    paths = output_paths(root)
    for name, lines in (("output", answers), ("errors", errors)):
        write_atomic(fs, paths[name], "".join(json.dumps(x) + "\n" for x in lines).encode())
    return paths


def _line_of(err: dict) -> int | None:
    """The line number an error row of a malformed line carries in its message."""
    message = err.get("message") or ""
    if message.startswith("line "):
        head = message[5:].split(":", 1)[0]
        return int(head) if head.isdigit() else None
    return None
