#!/usr/bin/env bash
# Instructions per request of each router in benches/layer.rs, counted by valgrind
# (callgrind): unlike time, the count does not drift with a shared machine's noise. Each
# variant serves N and then 2N requests in fresh processes; the difference divided by N
# is the cost of one request, set-up excluded.
#
# The simulated first-level instruction cache's misses (32 KiB, as valgrind models it)
# are counted too: a request's code lines that were not in the cache. An HTTP server's
# own code (the parser, the runtime, the kernel's syscalls) evicts a middleware's lines
# between requests, so the lines a middleware touches cost it, not only its instructions:
# a router with fewer instructions but more lines can still be the slower one.
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
# Prints "instructions instruction-cache-misses" of one process serving $2 requests,
# counted inside the runtime's `block_on` only (the serving loop): set-up outside it (the
# routers built, a CPU counter calibrated for a fixed time, which runs a varying number of
# instructions) once moved the per-request figure by hundreds between processes.
count() {
  LAYER_ONLY="$1" LAYER_COUNT="$2" valgrind --tool=callgrind --cache-sim=yes \
    --toggle-collect='tokio::runtime::runtime::Runtime::block_on' \
    --callgrind-out-file=/dev/null "$bench" --bench 2>&1 |
    awk '/Events/ {for (i = 3; i <= NF; i++) column[$i] = i - 1} /Collected/ {print $(column["Ir"] + 1), $(column["I1mr"] + 1)}'
}
echo "| router | instructions per request | over no limiter | instruction-cache misses per request | over no limiter |"
echo "|---|---|---|---|---|"
base=
for variant in "none" "identity layer" "fixed header fields" "governor" "tollgate" "tollgate, no headers"; do
  read -r a a_missed <<< "$(count "$variant" "$N")"
  read -r b b_missed <<< "$(count "$variant" $((2 * N)))"
  per=$(( (b - a) / N ))
  missed=$(( (b_missed - a_missed) / N ))
  if [ -z "$base" ]; then base=$per; base_missed=$missed; fi
  echo "| $variant | $per | $((per - base)) | $missed | $((missed - base_missed)) |"
done
