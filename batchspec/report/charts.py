"""Inline SVG bar charts for the HTML report. Plain strings, no JavaScript and no plotting
library, so the page is one self-contained file that opens offline in any browser."""
from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

WIDTH, HEIGHT = 560, 300
LEFT, RIGHT, TOP, BOTTOM = 52, 16, 40, 58
BAR, REFERENCE, GRID, INK, MUTED = "#4c78a8", "#e45756", "#e6e6e6", "#222", "#777"


def _nice_max(x: float) -> float:
    """A round axis end at or above x whose quarters are round too (4 gridlines)."""
    if x <= 4:
        return 4.0
    base = 10 ** math.floor(math.log10(x / 4))
    return 4 * next(m * base for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if 4 * m * base >= x)


def _fmt_tick(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 or v == int(v) and v > 1 else f"{v:g}"


def bar_chart(chart_id: str, title: str, labels: Sequence[str],
              values: Sequence[float | None], *, notes: Sequence[str] | None = None,
              reference: Sequence[float | None] | None = None, reference_label: str = "",
              y_max: float | None = 1.0, y_label: str = "α", value_format: str = "{:.2f}",
              edge_labels: bool = False, empty_text: str = "no speculative data") -> str:
    """One chart as an <svg> element. `notes` go under the labels (e.g. request counts);
    `reference` is drawn as a dashed line over the bars (e.g. a model's prediction).
    With edge_labels, labels are the len(values) + 1 bin edges (a histogram), every 4th shown."""
    n = len(values)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    known = [v for v in values if v is not None]
    top = y_max if y_max is not None else _nice_max(max(known, default=0))
    y = lambda v: TOP + plot_h * (1 - min(v, top) / top)  # noqa: E731
    slot = plot_w / max(n, 1)
    out = [f'<svg id="{chart_id}" class="chart" xmlns="http://www.w3.org/2000/svg" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">',
           f'<title>{escape(title)}</title>',
           f'<text x="{LEFT}" y="22" font-size="15" font-weight="600" fill="{INK}">'
           f'{escape(title)}</text>']
    for i in range(5):
        v = top * i / 4
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'stroke="{GRID}"/><text x="{LEFT - 6}" y="{y(v) + 4:.1f}" font-size="11" '
                   f'text-anchor="end" fill="{MUTED}">{_fmt_tick(v)}</text>')
    out.append(f'<text x="14" y="{TOP + plot_h / 2}" font-size="12" fill="{MUTED}" '
               f'text-anchor="middle" transform="rotate(-90 14 {TOP + plot_h / 2})">'
               f'{escape(y_label)}</text>')
    if not known:
        out.append(f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h / 2}" font-size="14" '
                   f'text-anchor="middle" fill="{MUTED}">{escape(empty_text)}</text>')
    for i, v in enumerate(values):
        label = labels[i]
        x0 = LEFT + i * slot
        cx, bar_w = x0 + slot / 2, slot * (0.92 if edge_labels else 0.62)
        if v is not None:
            out.append(f'<rect x="{cx - bar_w / 2:.1f}" y="{y(v):.1f}" width="{bar_w:.1f}" '
                       f'height="{TOP + plot_h - y(v):.1f}" fill="{BAR}"><title>'
                       f'{escape(label)}: {value_format.format(v)}</title></rect>')
        if edge_labels:
            continue
        shown, color, text_y = ("n/a", MUTED, y(0) - 5) if v is None else (
            value_format.format(v), INK, y(v) - 5)
        if reference and v is not None and y(0) - y(v) > 24:
            color, text_y = "#fff", y(v) + 15        # inside the bar, clear of the line
        out.append(f'<text x="{cx:.1f}" y="{text_y:.1f}" font-size="11" '
                   f'text-anchor="middle" fill="{color}">{shown}</text>')
        text = label if len(label) <= 16 else label[:15] + "…"
        out.append(f'<text x="{cx:.1f}" y="{TOP + plot_h + 16}" font-size="11" '
                   f'text-anchor="middle" fill="{INK}">{escape(text)}</text>')
        if notes:
            out.append(f'<text x="{cx:.1f}" y="{TOP + plot_h + 30}" font-size="10" '
                       f'text-anchor="middle" fill="{MUTED}">{escape(notes[i])}</text>')
    if edge_labels:
        out += [f'<text x="{LEFT + i * slot:.1f}" y="{TOP + plot_h + 16}" font-size="11" '
                f'text-anchor="middle" fill="{INK}">{escape(labels[i])}</text>'
                for i in range(0, n + 1, 4)]
    if reference and any(r is not None for r in reference):
        pts = " ".join(f"{LEFT + (i + 0.5) * slot:.1f},{y(r):.1f}"
                       for i, r in enumerate(reference) if r is not None)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{REFERENCE}" '
                   f'stroke-width="2" stroke-dasharray="6 4"/>')
        out.append(f'<text x="{WIDTH - RIGHT}" y="22" font-size="11" text-anchor="end" '
                   f'fill="{REFERENCE}">- - {escape(reference_label)}</text>')
    out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" '
               f'y2="{TOP + plot_h}" stroke="{MUTED}"/></svg>')
    return "\n".join(out)
