"""`batchspec report`: acceptance (α) of one or more jobs as a terminal summary, JSON and a
self-contained HTML page with charts. The numbers come from batchspec.report.analysis; this module
only lays them out (docs/acceptance-analysis.md says what each one means)."""
from __future__ import annotations

import json
import os
import re
from html import escape

import click

from batchspec import contract
from batchspec.jobs.display import draft_name
from batchspec.report.charts import bar_chart

PLAIN = "(plain)"
NUMBER = re.compile(r"-|[-+]?[\d,.]+%?")


def _num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:,}" if isinstance(x, int) else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _label(x, key: str = "draft") -> str:
    # A null draft means plain decoding; any other null key is just missing. A draft shows
    # as its model directory's name ('ngram' stays); the records keep the path.
    if x is None:
        return PLAIN if key == "draft" else "(none)"
    return draft_name(str(x)) if key == "draft" else str(x)


def notice(r: dict) -> str | None:
    """Why there is nothing to chart, when that is so."""
    if r["summary"]["requests"] == 0 and r.get("files") == 0:
        return "No acceptance records: the jobs wrote no shard (their inputs held no rows)."
    if r["summary"]["requests"] == 0:
        return "No acceptance records: the acceptance files hold no rows (empty shards)."
    if r["acceptance_rate"] is None:
        return ("No speculation: no request drafted anything (plain decoding or immediate "
                "fallback), so α is undefined.")
    return None


def summary_rows(r: dict) -> list[tuple[str, str]]:
    s, sp = r["summary"], r["speedup"]
    files = "" if r.get("files") is None else f" from {r['files']:,} file(s)"
    observed = ("n/a (needs speculative and plain requests of one target: add the output dir "
                "of a plain run of the same prompts)"
                if sp["observed_speedup"] is None else f"{sp['observed_speedup']:.2f}x")
    k = ",".join(map(str, sp["k"])) or "-"
    return [
        ("requests", f"{s['requests']:,} ({s['speculative_requests']:,} speculative){files}"),
        ("acceptance rate α (accepted / drafted)",
         f"{_num(r['acceptance_rate'])}  ({s['total_accepted']:,} / {s['total_drafted']:,})"),
        ("tokens from accepted drafts",
         f"{_pct(contract.draft_token_share(s['total_accepted'], s['tokens_generated']))}"
         f"  ({s['total_accepted']:,} / {s['tokens_generated']:,} generated)"),
        ("per-request α P50 / P90 / P99", " / ".join(_num(s[q]) for q in ("p50", "p90", "p99"))),
        ("per-token acceptance p", _num(r["token_acceptance_prob"])),
        ("tokens per target pass (speculative)",
         f"{_num(sp['tokens_per_pass'], 2)} observed, {_num(sp['predicted_tokens_per_pass'], 2)}"
         f" predicted by (1-p^(n+1))/(1-p), n each round's drafts (k={k})"),
        ("speedup_theoretical (engine, mean)", _num(sp["speedup_theoretical_mean"], 2)),
        ("observed speedup (tokens/s vs plain)", observed),
        ("rounds cut short by confidence", _pct(s["skip_rate"])),
        ("requests that fell back", _pct(s["fallback_rate"])),
        ("prompt tokens from the prefix cache",
         f"{_pct(s.get('prompt_cache_hit_rate'))}  ({s.get('cached_prompt_tokens') or 0:,} / "
         f"{s.get('prompt_tokens') or 0:,})"),
    ]


def tables(r: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of every table, shared by the terminal and the HTML page."""
    out = []
    for key, rows in r["by"].items():
        out.append((f"α by {key}",
                    [key, "requests", "α", "P50", "P90", "P99", "tokens/pass", "skip", "fallback"],
                    [[_label(g[key], key), _num(g["requests"]), _num(g["acceptance_rate"]),
                      _num(g["p50"]), _num(g["p90"]), _num(g["p99"]),
                      _num(g["mean_accepted_length"], 2), _pct(g["skip_rate"]),
                      _pct(g["fallback_rate"])] for g in rows]))
    out.append(("α by output position", ["position", "rounds", "drafted", "accepted", "α", "p"],
                [[g["position"], _num(g["rounds"]), _num(g["drafted"]), _num(g["accepted"]),
                  _num(g["acceptance_rate"]), _num(g["token_acceptance_prob"])]
                 for g in r["by_position"]]))
    if r.get("by_source"):
        out.append(("α by draft source", ["source", "rounds", "drafted", "accepted", "α", "p"],
                    [[_label(g["source"]), _num(g["rounds"]), _num(g["drafted"]),
                      _num(g["accepted"]), _num(g["acceptance_rate"]),
                      _num(g["token_acceptance_prob"])] for g in r["by_source"]]))
    out.append(("α by depth in the draft window",
                ["depth", "drafted", "accepted", "α", "i.i.d. p^(d+1)"],
                [[str(g["depth"]), _num(g["drafted"]), _num(g["accepted"]),
                  _num(g["acceptance_rate"]), _num(g["iid_prediction"])] for g in r["by_depth"]]))
    out.append(("Lowest-α requests",
                ["request_id", "job", "domain", "draft", "T", "drafted", "accepted", "α"],
                [[str(o["request_id"]), str(o["job_id"]), str(o["domain"]), _label(o["draft"]),
                  _num(o["temperature"], 2), _num(o["total_drafted"]),
                  _num(o["total_accepted"]), _num(o["acceptance_rate"])]
                 for o in r["outliers"]]))
    return out


def _text_table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    cols = list(zip(headers, *rows, strict=True))
    widths = [max(len(c) for c in col) for col in cols]
    # Numbers line up on the right, words on the left.
    is_text = [any(not NUMBER.fullmatch(c) for c in col[1:]) for col in cols]
    line = lambda cells: "  ".join(c.ljust(w) if t else c.rjust(w)  # noqa: E731
                                   for c, w, t in zip(cells, widths, is_text, strict=True))
    body = [line(r) for r in rows] or ["(none)"]
    return "\n".join([title, line(headers), "  ".join("-" * w for w in widths), *body])


def render_text(r: dict) -> str:
    width = max(len(k) for k, _ in summary_rows(r))
    parts = [notice(r)] if notice(r) else []
    parts.append("\n".join(f"{k.ljust(width)}  {v}" for k, v in summary_rows(r)))
    if r["acceptance_rate"] is not None:
        parts += [_text_table(*t) for t in tables(r)]
    return "\n\n".join(parts) + "\n"


def charts(r: dict) -> list[str]:
    """One <svg> per chart: position, depth, each --by key, distribution."""
    from batchspec.report.analysis import POSITION_BUCKETS
    pos = {g["position"]: g for g in r["by_position"]}
    out = [bar_chart("chart-position", "α by output position", POSITION_BUCKETS,
                     [pos.get(b, {}).get("acceptance_rate") for b in POSITION_BUCKETS],
                     notes=[f"{pos.get(b, {}).get('drafted', 0):,} drafted"
                            for b in POSITION_BUCKETS]),
           bar_chart("chart-depth", "α by depth in the draft window",
                     [str(g["depth"]) for g in r["by_depth"]],
                     [g["acceptance_rate"] for g in r["by_depth"]],
                     notes=[f"{g['drafted']:,} drafted" for g in r["by_depth"]],
                     reference=[g["iid_prediction"] for g in r["by_depth"]],
                     reference_label="p^(d+1): i.i.d. acceptance")]
    for key, rows in r["by"].items():
        out.append(bar_chart(f"chart-by-{key}", f"α by {key}", [_label(g[key], key) for g in rows],
                             [g["acceptance_rate"] for g in rows],
                             notes=[f"n={g['requests']:,}" for g in rows]))
    hist = r["histogram"]
    out.append(bar_chart("chart-distribution", "Per-request α distribution",
                         [f"{h['lo']:g}" for h in hist] + [f"{hist[-1]['hi']:g}"],
                         [h["count"] or None for h in hist], y_max=None, y_label="requests",
                         value_format="{:,.0f}", edge_labels=True))
    return out


STYLE = """body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;color:#222;
margin:24px auto;max-width:1160px;padding:0 16px}h1{font-size:22px;margin:0 0 4px}
h2{font-size:16px;margin:28px 0 8px}.notice{background:#fff4e5;border:1px solid #f0c36d;
padding:8px 12px;border-radius:4px}table{border-collapse:collapse;margin:8px 0}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right}
td:first-child,th:first-child{text-align:left}th{font-weight:600;border-bottom:1px solid #ccc}
.grid{display:grid;grid-template-columns:repeat(2,1fr);gap:16px}
.chart{border:1px solid #e6e6e6;border-radius:6px;background:#fff;max-width:100%;height:auto}"""


def _html_table(headers: list[str] | None, rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers or [])
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table>{head and f'<tr>{head}</tr>'}{body}</table>"


def render_html(r: dict) -> str:
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>batchspec acceptance report</title><style>{STYLE}</style></head><body>",
             "<h1>batchspec acceptance report</h1>"]
    if notice(r):
        parts.append(f"<p class='notice'>{escape(notice(r))}</p>")
    parts.append(_html_table(None, summary_rows(r)))
    parts.append("<div class='grid'>" + "".join(charts(r)) + "</div>")
    parts += [f"<h2>{escape(title)}</h2>{_html_table(headers, rows)}"
              for title, headers, rows in tables(r)]
    return "\n".join(parts + ["</body></html>\n"])


@click.command("report")
@click.argument("paths", nargs=-1, required=True, metavar="OUT...")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write every aggregate as JSON here (top-level acceptance_rate first).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Write a self-contained HTML page with charts here.")
@click.option("--by", default="domain,draft,temperature", show_default=True, metavar="KEYS",
              help="Comma-separated breakdowns: domain, draft, temperature, target, job, k, "
                   "or any record or hive-partition column.")
@click.option("--outliers", "num_outliers", default=10, show_default=True,
              type=click.IntRange(min=0), help="How many lowest-α requests to list.")
@click.option("--min-drafted", default=1, show_default=True, type=click.IntRange(min=0),
              help="Only requests that drafted at least this many tokens count as outliers.")
def report(paths, json_path, html_path, by, num_outliers, min_drafted):
    """Acceptance rate (α) of the jobs whose output dirs (or acceptance parquet files, or
    globs) are OUT...: overall, by domain/draft/temperature, by output position and draft
    depth, with the lowest-α requests."""
    from batchspec.report.analysis import NoAcceptanceData, analyze  # (polars: not for --help)
    keys = [k.strip() for k in by.split(",") if k.strip()]
    import polars as pl
    try:
        r = analyze(paths, by=keys, num_outliers=num_outliers, min_drafted=min_drafted)
    except NoAcceptanceData as e:
        raise click.UsageError(str(e)) from None
    except ImportError as e:     # a URL of a store whose fsspec package is not installed
        raise click.ClickException(str(e)) from None
    except pl.exceptions.PolarsError as e:     # a file damaged after its job wrote it
        from batchspec.report.records import unreadable_file
        bad = unreadable_file(paths)
        raise click.ClickException(
            f"{bad or 'an acceptance file'} cannot be read ({str(e).splitlines()[0]}): "
            f"restore it, or delete its shard's outputs file and run the job again, which "
            f"runs the shard again") from None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--by") from None
    click.echo(render_text(r), nl=False)
    for path, text in ((json_path, lambda: json.dumps(r, indent=2)),
                       (html_path, lambda: render_html(r))):
        if path:
            try:
                with open(path, "w") as f:
                    f.write(text())
            except OSError as e:
                raise click.ClickException(f"cannot write {path}: {e.strerror or e}") from None
            click.echo(f"wrote {os.path.abspath(path)}", err=True)


COMMANDS = [report]
