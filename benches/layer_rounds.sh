#!/usr/bin/env bash
# Time per request of routers of benches/layer.rs, each in a process of its own per
# round, in alternating order (the list forwards in odd rounds, backwards in even ones):
# a process's code layout and the machine's moment are shared out evenly between the
# routers. Prints each router's median nanoseconds per request and the median of its
# per-round ratios to the first router's time.
#
#   benches/layer_rounds.sh                          # tower_governor, tollgate, none
#   ROUNDS=16 COUNT=800000 benches/layer_rounds.sh governor tollgate
#   BENCH=/path/to/other/layer benches/layer_rounds.sh tollgate    # another build's binary
#
# A router may also be written BINARY:ROUTER, to set two builds side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-16}
COUNT=${COUNT:-800000}
if [ $# -eq 0 ]; then set -- governor tollgate none; fi
bench=${BENCH:-$(cargo bench --bench layer --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "layer" and m.get("executable"):
        print(m["executable"])')}
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for round in $(seq "$ROUNDS"); do
  routers=("$@")
  if (( round % 2 == 0 )); then mapfile -t routers < <(printf '%s\n' "$@" | tac); fi
  for router in "${routers[@]}"; do
    binary=$bench name=$router
    if [[ $router == *:* ]]; then binary=${router%%:*} name=${router#*:}; fi
    ns=$(LAYER_ONLY="$name" LAYER_COUNT="$COUNT" "$binary" --bench | awk '{print $(NF-2)}')
    printf '%s\t%s\n' "$router" "$ns" >> "$results"
  done
done
python3 - "$results" "$@" <<'PY'
import collections, statistics, sys
times = collections.defaultdict(list)
for line in open(sys.argv[1]):
    router, ns = line.rstrip("\n").split("\t")
    times[router].append(float(ns))
routers = sys.argv[2:]
first = times[routers[0]]
print("| router | ns per request (median) | vs " + routers[0] + " (median of per-round ratios) |")
print("|---|---|---|")
for router in routers:
    ratios = [a / b for a, b in zip(times[router], first)]
    print(f"| {router} | {statistics.median(times[router]):.0f} | {statistics.median(ratios):.3f} |")
PY
