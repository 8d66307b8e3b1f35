#!/usr/bin/env bash
# Time per request of routers of benches/layer.rs, each in a process of its own per
# round, in alternating order (the list forwards in odd rounds, backwards in even ones):
# a process's code layout and the machine's moment are shared out evenly between the
# routers. Prints each router's median nanoseconds per request and the median of its
# per-round ratios to the first router's time.
#
#   benches/layer_rounds.sh                          # governor, tollgate, none
#   ROUNDS=16 COUNT=800000 benches/layer_rounds.sh governor tollgate
#   BENCH=/path/to/other/layer benches/layer_rounds.sh tollgate    # another build's binary
#
# A router may also be written BINARY:ROUTER (split at the last colon), to set two builds
# side by side. Router names are those benches/layer.rs prints ("none", "governor",
# "tollgate", "tollgate, no headers", ...); each may be listed once.
set -euo pipefail
ROUNDS=${ROUNDS:-16}
COUNT=${COUNT:-800000}
fail() { echo "benches/layer_rounds.sh: $*" >&2; exit 1; }
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || fail "ROUNDS must be a positive whole number, not '$ROUNDS'"
[[ $COUNT =~ ^[1-9][0-9]*$ ]] || fail "COUNT must be a positive whole number, not '$COUNT'"
if [ $# -eq 0 ]; then set -- governor tollgate none; fi
# Binaries named on the command line are read from where it was run.
absolute() { [[ $1 == /* ]] && echo "$1" || echo "$PWD/$1"; }
routers=()
build=0
for router in "$@"; do
  if [[ $router == *:* ]]; then
    binary=$(absolute "${router%:*}")
    [ -x "$binary" ] || fail "no executable $binary"
    router="$binary:${router##*:}"
  else
    build=1
  fi
  for seen in "${routers[@]+"${routers[@]}"}"; do
    [ "$seen" != "$router" ] || fail "router '$router' is listed twice"
  done
  routers+=("$router")
done
if [ -n "${BENCH:-}" ]; then
  bench=$(absolute "$BENCH")
  [ -x "$bench" ] || fail "no executable $bench (BENCH)"
  build=0
fi
cd "$(dirname "$0")/.."
if (( build )); then
  built=$(mktemp)
  if ! cargo bench --bench layer --no-run --message-format=json 2>"$built.err" >"$built"; then
    cat "$built.err" >&2
    rm -f "$built" "$built.err"
    fail "building benches/layer.rs failed"
  fi
  bench=$(python3 -c 'import json,sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "layer" and m.get("executable"):
        print(m["executable"])' "$built")
  rm -f "$built" "$built.err"
  [ -n "$bench" ] || fail "cargo built no benches/layer.rs executable"
fi
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for round in $(seq "$ROUNDS"); do
  order=("${routers[@]}")
  if (( round % 2 == 0 )); then mapfile -t order < <(printf '%s\n' "${routers[@]}" | tac); fi
  for router in "${order[@]}"; do
    binary=${bench:-} name=$router
    if [[ $router == *:* ]]; then binary=${router%:*} name=${router##*:}; fi
    ns=$(LAYER_ONLY="$name" LAYER_COUNT="$COUNT" "$binary" --bench | awk '{print $(NF-2)}')
    [[ $ns =~ ^[0-9]+$ ]] ||
      fail "no time for router '$name' from $binary (a name benches/layer.rs does not print?)"
    printf '%s\t%s\n' "$router" "$ns" >> "$results"
  done
done
python3 - "$results" "${routers[@]}" <<'PY'
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
