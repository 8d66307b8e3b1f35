#!/usr/bin/env bash
# Where the HTTP server's time goes beyond instructions: each variant of `bench_server`
# runs under valgrind's cache model (cachegrind: 32 KiB 8-way L1 caches, 64-byte lines)
# while `wrk -t1 -c32` loads it on loopback, and the instructions, instruction-cache
# misses (I1) and data-cache misses (D1) per request are printed. A server's user-space
# code for one request (hyper, tokio, axum) is larger than the L1 instruction cache, so in
# the model the I1 misses roughly track the lines of code a request walks through, which
# the instruction count alone does not show. Valgrind sees no kernel code, models no
# prefetcher, and runs the server with one worker.
#
# The counts do not drift with a shared machine's load the way time does; they move by
# a few per cent between runs (connections interleave differently). Threads run one at a
# time under valgrind, so what cores share (cache lines bouncing between them) is not
# modelled: that part is measured by benches/http_load.sh and benches/layer.rs only.
#
#   benches/http_cache.sh                          # none identity-layer static-headers store-only governor tollgate tollgate-bare
#   VARIANTS="governor tollgate" DURATION=20 benches/http_cache.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
PORT=${PORT:-3195}
VARIANTS=${VARIANTS:-"none identity-layer static-headers store-only governor tollgate tollgate-bare"}

command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)" >&2; exit 1; }
cargo build --release --example bench_server >&2
server=target/release/examples/bench_server
out=$(mktemp)
log=$(mktemp)
# Stop a server still running (valgrind writes its output as it exits), then clean up.
trap 'if [ -n "${pid:-}" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; rm -f "$out" "$log"' EXIT

echo "| server | instructions per request | I1 misses per request | D1 misses per request |"
echo "|---|---|---|---|"
for variant in $VARIANTS; do
  : > "$out"
  # Sizes given explicitly: valgrind would otherwise take this machine's caches.
  WORKERS=1 valgrind --tool=cachegrind --cache-sim=yes --I1=32768,8,64 --D1=32768,8,64 \
    --LL=2097152,16,64 --cachegrind-out-file="$out" "$server" "$variant" "$PORT" >/dev/null 2>"$log" &
  pid=$!
  for _ in $(seq 300); do
    curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break
    kill -0 "$pid" 2>/dev/null || { echo "$variant: the server did not start:" >&2; cat "$log" >&2; exit 1; }
    sleep 0.1
  done
  # Start-up is counted too; at tens of thousands of requests it is well under 1%.
  requests=$(wrk -t1 -c"${CONNECTIONS:-32}" -d"${DURATION}s" "http://127.0.0.1:$PORT/" | awk '/requests in/ {print $1}') || true
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true; pid=
  if [ -z "$requests" ] || [ "$requests" -eq 0 ]; then
    echo "$variant: wrk completed no request" >&2; exit 1
  fi
  python3 - "$variant" "$requests" "$out" <<'PY'
import sys
variant, requests, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
events = totals = None
for line in open(path):
    if line.startswith("events:"):
        events = line.split()[1:]
    elif line.startswith("summary:"):
        totals = [int(x) for x in line.split()[1:]]
if not events or not totals:
    sys.exit(f"{variant}: cachegrind wrote no totals")
count = dict(zip(events, totals))
per = lambda value: value / requests
print(f"| {variant} | {per(count['Ir']):,.0f} | {per(count['I1mr']):,.0f} | {per(count['D1mr'] + count['D1mw']):,.0f} |")
PY
done
