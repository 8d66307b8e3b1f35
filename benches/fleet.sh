#!/usr/bin/env bash
# The fleet benchmark: three replicas of an app (examples/bench_server.rs, variant
# tollgate-fleet) share one quota through Redis, on loopback; one wrk per replica loads
# them at once. For a standalone Redis, then a three-primary Redis Cluster, and for exact
# decisions, then leases, two runs:
# - a quota of LIMIT that runs out early: requests admitted fleet-wide against the limit
#   (exact: exactly the limit; leases: never above it, at least the limit less one lease
#   per replica);
# - a quota that never runs out: requests per second per replica, and Redis CPU and
#   script calls per request (INFO commandstats, summed over the nodes).
# Every request is for one identity (the quota is fleet-wide): a hot key, where
# coalescing batches concurrent decisions.
#
#   benches/fleet.sh                       # 5 s per run, LIMIT=20000, LEASE=20
#   DURATION=10 LIMIT=50000 LEASE=50 benches/fleet.sh
#
# Every process it starts listens on 127.0.0.1 only and is stopped when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
LIMIT=${LIMIT:-20000}
LEASE=${LEASE:-20}
CONNECTIONS=${CONNECTIONS:-16}
BASE_PORT=${BASE_PORT:-3290}
REDIS_BASE=${REDIS_BASE:-6490}
REPLICAS=3

for tool in wrk redis-server redis-cli curl; do
  command -v "$tool" >/dev/null || { echo "benches/fleet.sh needs $tool" >&2; exit 1; }
done

cargo build --release --quiet --features redis --example bench_server
server=target/release/examples/bench_server

# Every port this script listens on must be free: a Redis already there would be
# flushed and shut down, and a server already there measured in place of the replicas.
in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# (A Cluster node also listens on its port + 10000, its bus.)
for port in $(seq "$BASE_PORT" $((BASE_PORT + REPLICAS - 1))) $(seq "$REDIS_BASE" $((REDIS_BASE + 3))) \
  $(seq $((REDIS_BASE + 10001)) $((REDIS_BASE + 10003))); do
  if in_use "$port"; then
    echo "benches/fleet.sh: port $port is in use (set BASE_PORT or REDIS_BASE)" >&2
    exit 1
  fi
done

work=$(mktemp -d)
redis_ports=()
# The replicas' process ids, one per line: `run` starts them in a subshell (its output
# is captured), so they are written to a file, not to a variable this shell would not
# see. Background processes of a script ignore Ctrl-C: cleanup stops them on any exit.
cleanup() {
  if [ -f "$work/pids" ]; then
    while read -r pid; do kill "$pid" 2>/dev/null || true; done <"$work/pids"
  fi
  for port in "${redis_ports[@]:-}"; do
    [ -n "$port" ] && redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_redis() { # port [extra args...]
  local port=$1
  shift
  mkdir -p "$work/redis-$port"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$work/redis-$port" --daemonize yes --logfile "$work/redis-$port/log" "$@"
  redis_ports+=("$port")
  for _ in $(seq 100); do
    [ "$(redis-cli -p "$port" ping 2>/dev/null)" = PONG ] && return 0
    sleep 0.05
  done
  echo "redis-server on $port did not start" >&2
  exit 1
}

# `field NAME` of every script command, summed over the nodes.
script_stat() { # name ports...
  local name=$1
  shift
  local total=0 port value
  for port in "$@"; do
    value=$(redis-cli -p "$port" info commandstats | tr -d '\r' |
      awk -F'[:,=]' -v want="$name" '/^cmdstat_(evalsha|eval|fcall):/ {
        for (i = 2; i < NF; i += 2) if ($i == want) sum += $(i + 1)
      } END { print sum + 0 }')
    total=$((total + value))
  done
  echo "$total"
}

# One run: $1 = topology label, $2 = lease size (0: exact), $3 = the quota, then the
# Redis node ports.
run() {
  local topology=$1 lease=$2 limit=$3
  shift 3
  local nodes=("$@")
  for port in "${nodes[@]}"; do
    redis-cli -p "$port" flushall >/dev/null
    redis-cli -p "$port" config resetstat >/dev/null
  done
  local env_redis
  if [ "$topology" = cluster ]; then
    env_redis="REDIS_CLUSTER=$(printf 'redis://127.0.0.1:%s,' "${nodes[@]}" | sed 's/,$//')"
  else
    env_redis="REDIS_URL=redis://127.0.0.1:${nodes[0]}"
  fi
  local app_pids=()
  for i in $(seq 0 $((REPLICAS - 1))); do
    env "$env_redis" LIMIT="$limit" LEASE="$lease" \
      "$server" tollgate-fleet $((BASE_PORT + i)) >"$work/app-$i.log" 2>&1 &
    app_pids+=($!)
    echo "$!" >>"$work/pids"
  done
  for i in $(seq 0 $((REPLICAS - 1))); do
    for _ in $(seq 200); do
      curl -s -o /dev/null "http://127.0.0.1:$((BASE_PORT + i))/" 2>/dev/null && break
      sleep 0.05
    done
  done
  # The readiness probes spent units too: count them out of the quota by starting the
  # quota's count after them (they are at most one per replica).
  local probes=$REPLICAS
  local wrk_pids=()
  for i in $(seq 0 $((REPLICAS - 1))); do
    wrk -t1 -c"$CONNECTIONS" -d"${DURATION}s" "http://127.0.0.1:$((BASE_PORT + i))/" \
      >"$work/wrk-$i.txt" 2>&1 &
    wrk_pids+=($!)
    echo "$!" >>"$work/pids"
  done
  wait "${wrk_pids[@]}"
  local requests=0 refused=0 rates=()
  for i in $(seq 0 $((REPLICAS - 1))); do
    local total non2xx rate
    total=$(awk '/requests in/ {print $1}' "$work/wrk-$i.txt")
    non2xx=$(awk '/Non-2xx or 3xx responses/ {print $5}' "$work/wrk-$i.txt")
    rate=$(awk '/^Requests\/sec/ {printf "%.0f", $2}' "$work/wrk-$i.txt")
    requests=$((requests + total))
    refused=$((refused + ${non2xx:-0}))
    rates+=("$rate")
  done
  local admitted=$((requests - refused + probes))
  local calls usec
  calls=$(script_stat calls "${nodes[@]}")
  usec=$(script_stat usec "${nodes[@]}")
  local decisions=$((requests + probes))
  local mode=exact bound="= $limit"
  if [ "$lease" -gt 0 ]; then
    mode="leases of $lease"
    bound="$((limit - REPLICAS * lease))..$limit"
  fi
  if [ "$limit" = "$LIMIT" ]; then
    printf '| %s | %s | %d | %s | %s |\n' "$topology" "$mode" "$admitted" "$bound" \
      "$requests"
  else
    printf '| %s | %s | %s | %.3f | %.2f µs |\n' \
      "$topology" "$mode" "$(IFS=/; echo "${rates[*]}")" \
      "$(awk -v a="$calls" -v b="$decisions" 'BEGIN { print a / b }')" \
      "$(awk -v a="$usec" -v b="$decisions" 'BEGIN { print a / b }')"
  fi
  for pid in "${app_pids[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  # Stopped and reaped: their ids are not signalled again (they may be reused by then).
  : >"$work/pids"
}

NEVER=0

# Runs every measurement on the nodes at $@ (label first).
measure() {
  local topology=$1
  shift
  RESULTS_EXACT+=("$(run "$topology" 0 "$LIMIT" "$@")")
  RESULTS_EXACT+=("$(run "$topology" "$LEASE" "$LIMIT" "$@")")
  RESULTS_COST+=("$(run "$topology" 0 "$NEVER" "$@")")
  RESULTS_COST+=("$(run "$topology" "$LEASE" "$NEVER" "$@")")
}
RESULTS_EXACT=()
RESULTS_COST=()

standalone=$REDIS_BASE
start_redis "$standalone"
measure standalone "$standalone"
redis-cli -p "$standalone" shutdown nosave >/dev/null 2>&1 || true

cluster_ports=($((REDIS_BASE + 1)) $((REDIS_BASE + 2)) $((REDIS_BASE + 3)))
for port in "${cluster_ports[@]}"; do
  start_redis "$port" --cluster-enabled yes --cluster-config-file "$work/nodes-$port.conf"
done
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${cluster_ports[@]}") \
  --cluster-replicas 0 --cluster-yes >/dev/null
for port in "${cluster_ports[@]}"; do
  for _ in $(seq 200); do
    redis-cli -p "$port" cluster info | grep -q cluster_state:ok && break
    sleep 0.05
  done
done
measure cluster "${cluster_ports[@]}"

echo "fleet: $REPLICAS replicas, wrk -t1 -c$CONNECTIONS -d${DURATION}s against each at once"
echo
echo "A quota of $LIMIT shared fleet-wide (a bucket that does not refill during the run):"
echo
echo "| Redis | decisions | admitted fleet-wide | bound | requests sent |"
echo "|---|---|---|---|---|"
printf '%s\n' "${RESULTS_EXACT[@]}"
echo
echo "A quota that never runs out: throughput and what each request costs Redis:"
echo
echo "| Redis | decisions | requests/s per replica | script calls per request | Redis CPU per request |"
echo "|---|---|---|---|---|"
printf '%s\n' "${RESULTS_COST[@]}"
