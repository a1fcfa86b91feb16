#!/usr/bin/env bash
# Render a `batchspec report --html` page in headless Chromium, check that every chart is in
# the rendered DOM, and save a screenshot.
#
#   scripts/screenshot_report.sh [REPORT.html] [OUT.png]
#
# Without REPORT.html it makes one from 20,000 synthetic records (benchmarks/bench_report.py).
# OUT.png defaults to docs/img/report.png. CHARTS overrides the chart ids to require.
set -euo pipefail
cd "$(dirname "$0")/.."

html=${1:-}
png=${2:-docs/img/report.png}
charts=${CHARTS:-"chart-position chart-depth chart-by-domain chart-by-temperature chart-distribution"}
chromium=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$chromium" ] || { echo "chromium not found (apt-get install -y chromium)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$html" ]; then
    html=$work/report.html
    python benchmarks/bench_report.py --records 20000 --out "$work/jobs" --html "$html" >/dev/null
fi

flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run
       --disable-background-networking --disable-component-update --disable-sync
       --user-data-dir="$work/profile")
url="file://$(realpath "$html")"

"$chromium" "${flags[@]}" --dump-dom "$url" 2>/dev/null >"$work/dom.html"
missing=0
for id in $charts; do
    if ! grep -q "<svg id=\"$id\"" "$work/dom.html"; then
        echo "missing chart: $id" >&2
        missing=1
    fi
done
[ "$missing" = 0 ] || exit 1

mkdir -p "$(dirname "$png")"
"$chromium" "${flags[@]}" --hide-scrollbars --window-size=1200,2400 --screenshot="$(realpath -m "$png")" "$url" 2>/dev/null
echo "all charts present ($charts); screenshot: $png"
