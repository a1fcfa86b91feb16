"""An OpenAI Batch request file in the shape of the OpenAI documentation's examples (chat
completions and completions bodies), two malformed lines among them, and the Parquet table
of the same requests."""
from __future__ import annotations

import json

import pyarrow as pa

TOPICS = ["a haiku about rivers", "the capital of France", "how to sort a list",
          "why the sky is blue", "a limerick about cats", "the boiling point of water",
          "three prime numbers", "a short greeting"]
NUM_GOOD = 52
# line number (1-based, in the file) -> error_type of the malformed lines
BAD_LINES = {7: "invalid_json", 30: "unsupported_url"}


def request_lines() -> tuple[list[str], list[dict]]:
    """(the file's lines, the good requests as Parquet rows: id, prompt or messages,
    overrides)."""
    lines, rows = [], []
    for i in range(NUM_GOOD):
        if len(lines) + 1 in BAD_LINES:
            lines.append(_bad_line(len(lines) + 1))
        custom_id = f"request-{i + 1}"
        topic = TOPICS[i % len(TOPICS)]
        row = {"id": custom_id, "prompt": None, "messages": None, "temperature": None,
               "top_p": None, "max_tokens": None, "seed": None, "stop": None}
        if i % 3 == 2:      # a completion, as in the docs' /v1/completions example
            body = {"model": "gpt-3.5-turbo-instruct", "prompt": f"Write {topic}.",
                    "max_tokens": 5 + i % 4}
            row |= {"prompt": body["prompt"], "max_tokens": body["max_tokens"]}
            url = "/v1/completions"
        else:               # a chat completion, as in the docs' first example
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": f"Tell me {topic}."}]
            body = {"model": "gpt-4o-mini", "messages": messages,
                    "max_completion_tokens": 6 + i % 3}
            row |= {"messages": messages, "max_tokens": body["max_completion_tokens"]}
            url = "/v1/chat/completions"
        if i % 4 == 1:      # sampled, with a seed and nucleus sampling
            body |= {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i}
            row |= {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i}
        if i % 5 == 3:
            body["stop"] = ["\n\n", "."]
            row["stop"] = body["stop"]
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                                 "body": body}))
        rows.append(row)
    return lines, rows


def _bad_line(number: int) -> str:
    if BAD_LINES[number] == "invalid_json":     # cut short
        return '{"custom_id": "request-cut", "method": "POST", "url": "/v1/chat/completions"'
    return json.dumps({"custom_id": "request-embed", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "text-embedding-3-small", "input": "hello"}})


def write_requests(path) -> list[dict]:
    """Write the request file (a blank line at the end, as editors leave); returns the
    good requests as rows."""
    lines, rows = request_lines()
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n\n")
    return rows


def parquet_table(rows: list[dict]) -> pa.Table:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()),
                        ("messages", pa.list_(message)), ("temperature", pa.float64()),
                        ("top_p", pa.float64()), ("max_tokens", pa.int64()),
                        ("seed", pa.int64()), ("stop", pa.list_(pa.string()))])
    return pa.Table.from_pylist(rows, schema)
