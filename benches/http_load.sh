#!/usr/bin/env bash
# HTTP overhead of the limiter: requests per second of an axum hello-world with no
# limiter, with tower_governor and with tollgate (in-process store, peer-IP key, headers
# on every response), under the same wrk load on loopback. Variants are interleaved over
# several rounds (shared machines drift); each round's figure is divided by the same
# round's no-limiter figure, and the medians of those ratios are reported. Beside
# requests/s, the server's own CPU time (user and system, from /proc) per request served,
# and its per-round ratio to no limiter: the cost of the layer to the server, which what
# else the machine runs blurs less than it blurs throughput. Two more tables compare each
# variant with no limiter and with governor (each when in the run) directly, round by
# round: the median of the per-round ratios with a 95% interval, and a sign test of the
# rounds ahead (python3 3.8 or later prints them; without it the first table alone). Here 31 rounds catch a 5% difference about half the time and 6 to 7%
# reliably; telling 2% apart takes about 150 to 200 rounds.
#
# By default the server runs tokio's default multi-thread runtime and shares the machine's
# cores with `wrk -t1 -c32`, as on a small host; PIN=1 pins the server (one worker) to core
# 0 and wrk to core 1 instead.
#
#   benches/http_load.sh                 # 7 rounds x 3 s per variant
#   ROUNDS=5 DURATION=10 benches/http_load.sh
#   VARIANTS="none tollgate tollgate-redis" benches/http_load.sh   # adds a redis-server
#   OUTER=1 VARIANTS="none static-headers governor tollgate" benches/http_load.sh
#       # each limiter around the whole router (before routing), not by Router::layer
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-7}
DURATION=${DURATION:-3}
CONNECTIONS=${CONNECTIONS:-32}
PORT=${PORT:-3190}
VARIANTS=${VARIANTS:-"none governor tollgate"}

if ! command -v wrk >/dev/null; then
  echo "installing wrk" >&2
  apt-get install -y wrk >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y wrk >/dev/null; }
fi
command -v curl >/dev/null || { echo "curl is needed" >&2; exit 1; }

# The ports must be free: a server already there would be measured, or written to.
in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if in_use "$PORT"; then
  echo "benches/http_load.sh: port $PORT is in use (set PORT)" >&2
  exit 1
fi

results=$(mktemp)
# Each step of the clean-up on its own (`set -e` would stop it at the first that fails,
# a server already dead, and leave Redis running).
cleanup() {
  rm -f "$results"
  if [ -n "${pid:-}" ]; then kill "$pid" 2>/dev/null || true; fi
  if [ -n "${redis_pid:-}" ]; then kill "$redis_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
features=()
if [[ " $VARIANTS " == *" tollgate-redis "* ]]; then
  features=(--features redis)
  command -v redis-server >/dev/null || { echo "redis-server is needed for tollgate-redis" >&2; exit 1; }
  REDIS_PORT=${REDIS_PORT:-6391}
  if in_use "$REDIS_PORT"; then
    echo "benches/http_load.sh: port $REDIS_PORT is in use (set REDIS_PORT)" >&2
    exit 1
  fi
  # Redis shares the server's core: one machine running app and Redis.
  taskset -c 0 redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
  redis_pid=$!
  export REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
  for _ in $(seq 100); do
    [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ] && break
    sleep 0.05
  done
  [ "$(redis-cli -p "$REDIS_PORT" ping 2>/dev/null)" = PONG ] ||
    { echo "redis-server on $REDIS_PORT did not start (port in use?)" >&2; exit 1; }
  sleep 0.5
fi
cargo build --release "${features[@]}" --example bench_server >&2
server=target/release/examples/bench_server

# utime + stime of a process, in clock ticks (fields 14 and 15 of /proc/PID/stat).
# 0 for a process gone (a server that died: its round counts as 0).
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
HZ=$(getconf CLK_TCK)

read -r -a order <<< "$VARIANTS"
for round in $(seq "$ROUNDS"); do
  # Rotate the order every round, so no variant always runs first or last.
  shift_by=$(( round % ${#order[@]} ))
  rotated=("${order[@]:shift_by}" "${order[@]:0:shift_by}")
  for variant in "${rotated[@]}"; do
    # Server on one core, load generator on the other: no fighting over a core.
    if [ "${PIN:-0}" = 1 ]; then
      WORKERS=1 taskset -c 0 "$server" "$variant" "$PORT" >/dev/null &
    else
      "$server" "$variant" "$PORT" >/dev/null &
    fi
    pid=$!
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 0.05; done
    if [ "${PIN:-0}" = 1 ]; then wrk=(taskset -c 1 wrk); else wrk=(wrk); fi
    # A round that served nothing (wrk failed, the server died) counts as 0 and is left
    # out of the ratios and the counts below.
    # The server's own CPU time (user and system, all its threads) over the load, per
    # request served: what the layer costs the server, less blurred than requests/s by
    # what else the machine runs (wrk shares the cores).
    before=$(cpu_ticks "$pid")
    out=$("${wrk[@]}" -t1 -c"$CONNECTIONS" -d"${DURATION}s" "http://127.0.0.1:$PORT/") || true
    after=$(cpu_ticks "$pid")
    rps=$(awk '/Requests\/sec/ {print $2}' <<< "$out")
    rps=${rps:-0}
    served=$(awk '/requests in/ {print $1}' <<< "$out")
    # A limiter that refused the load generator would measure its 429s: said.
    refused=$(awk '/Non-2xx or 3xx responses/ {print $5}' <<< "$out")
    if [ "${refused:-0}" -gt 0 ]; then
      echo "warning: $variant answered $refused of ${served:-0} requests with no 2xx" >&2
    fi
    if [ "$variant" = tollgate-redis ]; then redis_served=$(( ${redis_served:-0} + ${served:-0} )); fi
    cpu_us=$(awk -v a="$before" -v b="$after" -v n="${served:-0}" -v hz="$HZ" \
      'BEGIN {if (n > 0 && b >= a) printf "%.2f", (b - a) * 1e6 / hz / n; else print 0}')
    non2xx=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/")
    kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=
    echo "round $round $variant $rps requests/s, $cpu_us us of server CPU a request (status after load: $non2xx)" >&2
    echo "$round $variant $rps $cpu_us" >> "$results"
  done
done

# The Redis variant's decisions must be Redis's: a store timing out on these shared
# cores is answered by the in-process fallback, which this count would show.
if [ -n "${redis_pid:-}" ]; then
  calls=$(redis-cli -p "$REDIS_PORT" info commandstats | tr -d '\r' |
    awk -F'[:,=]' '/^cmdstat_(evalsha|eval|fcall):/ {s += $3} END {print s + 0}')
  echo "Redis ran $calls script calls (a coalesced batch is one) for ${redis_served:-0} requests tollgate-redis served" >&2
fi

# RESULTS=path keeps the rounds (round, variant, requests/s, µs of server CPU a request),
# to pool runs with benches/http_tables.py (python3 benches/http_tables.py FILE...).
if [ -n "${RESULTS:-}" ]; then cp "$results" "$RESULTS"; fi
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo
# With governor in the run, each variant's rounds faster than governor's same round (ties
# left out): a paired count, which the machine's drift between rounds does not blur as it
# does medians.
echo "| server | requests/s (median of $ROUNDS rounds) | vs no limiter (median of per-round ratios) | rounds ahead of governor | server CPU per request (median) | vs no limiter (median of per-round ratios) |"
echo "|---|---|---|---|---|---|"
for variant in $VARIANTS; do
  rps=$(awk -v v="$variant" '$2 == v && $3 > 0 {print $3}' "$results" | median)
  ratio=$(awk -v v="$variant" '$2 == "none" {base[$1] = $3} $2 == v && $3 > 0 {rps[$1] = $3}
    END {for (r in rps) if (base[r] > 0) printf "%.4f\n", rps[r] / base[r]}' "$results" | median)
  ahead=$(awk -v v="$variant" '$2 == "governor" && $3 > 0 {g[$1] = $3} $2 == v && $3 > 0 {rps[$1] = $3}
    END {n = 0; a = 0; for (r in rps) if (r in g && rps[r] + 0 != g[r] + 0) {n++; if (rps[r] + 0 > g[r] + 0) a++}
      if (n == 0 || v == "governor") print "-"; else printf "%d of %d\n", a, n}' "$results")
  cpu=$(awk -v v="$variant" '$2 == v && $3 > 0 {print $4}' "$results" | median)
  cpu_ratio=$(awk -v v="$variant" '$2 == "none" && $4 > 0 {base[$1] = $4} $2 == v && $3 > 0 {cpu[$1] = $4}
    END {for (r in cpu) if (base[r] > 0) printf "%.4f\n", cpu[r] / base[r]}' "$results" | median)
  printf "| %s | %.0f | %.3f | %s | %.2f µs | %.3f |\n" "$variant" "$rps" "$ratio" "$ahead" "$cpu" "$cpu_ratio"
done

# Paired by round, against no limiter and against governor: medians of per-round ratios
# with intervals, geometric means with t-intervals, and sign tests (see
# benches/http_tables.py, which also pools the rounds several runs kept with RESULTS).
if python3 -c 'import math; math.comb' 2>/dev/null; then
  python3 benches/http_tables.py --variants "${order[*]}" "$results"
else
  echo "no python3 3.8 or later: no paired comparisons with intervals" >&2
fi
