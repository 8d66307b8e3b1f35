#!/usr/bin/env bash
# Instructions per request of each router in benches/layer.rs, counted by valgrind
# (callgrind): unlike time, the count does not drift with a shared machine's noise. Each
# variant serves N and then 2N requests in fresh processes; the difference divided by N
# is the cost of one request, set-up excluded.
#
#   benches/layer_instructions.sh            # N = 20000
#   N=50000 benches/layer_instructions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-20000}
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
bench=$(cargo bench --bench layer --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "layer" and m.get("executable"):
        print(m["executable"])')
count() {
  LAYER_ONLY="$1" LAYER_COUNT="$2" valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bench" --bench 2>&1 |
    awk '/Collected/ {print $4}'
}
echo "| router | instructions per request | over no limiter |"
echo "|---|---|---|"
base=
for variant in "none" "identity layer" "fixed header fields" "governor" "tollgate" "tollgate, no headers"; do
  a=$(count "$variant" "$N")
  b=$(count "$variant" $((2 * N)))
  per=$(( (b - a) / N ))
  [ -z "$base" ] && base=$per
  echo "| $variant | $per | $((per - base)) |"
done
