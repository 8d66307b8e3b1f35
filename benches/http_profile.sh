#!/usr/bin/env bash
# Where each HTTP server's CPU goes, function by function, in a real run: `perf record`
# samples the server's threads on the CPU clock (software sampling: no hardware counters
# needed) while `wrk -t1 -c32` loads it on loopback, and each function's samples are
# turned into nanoseconds of server CPU a request. Unlike benches/http_cache.sh (a cache
# model, one worker, threads one at a time), this sees the default runtime's two workers
# on two cores, the kernel, and what cache lines passed between the cores cost, charged to
# the function that waited for them.
#
# Variants rotate over rounds and their samples are pooled per variant. Printed: each
# variant's sampled CPU a request; the functions named for the first two variants'
# limiters (names containing `tollgate::` or `governor`: their own functions, and code of
# other crates instantiated for their types, such as drops; what they call in other
# crates, such as the header map's insertions or integer formatting, is not among them,
# and what the compiler inlined is its caller's); and the functions whose cost a request
# differs most between the first two variants, whatever crate they are in: the table to
# read for where one limiter costs more than the other. Each sample counts the CPU time
# it stands for (perf's period, in nanoseconds on the CPU clock), so a throttled
# sampling rate lowers no figure. Sampling adds its own cost (a few per cent at the
# default 4 kHz), alike for every variant; figures under about 20 ns a request are within
# a run's noise. Run as root, or with kernel.perf_event_paranoid at 1 or less: otherwise
# perf samples user space only, and the kernel's share is missing (said below).
#
#   benches/http_profile.sh                              # governor tollgate, 4 rounds x 5 s
#   VARIANTS="tollgate governor" ROUNDS=8 FREQ=10000 benches/http_profile.sh
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-4}
DURATION=${DURATION:-5}
FREQ=${FREQ:-4000}
PORT=${PORT:-3196}
VARIANTS=${VARIANTS:-"governor tollgate"}
TOP=${TOP:-25}

command -v perf >/dev/null || { echo "perf is needed (apt-get install linux-tools-common linux-tools-generic, or linux-perf)" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is needed" >&2; exit 1; }
in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if in_use "$PORT"; then
  echo "benches/http_profile.sh: port $PORT is in use (set PORT)" >&2
  exit 1
fi
cargo build --release --example bench_server >&2
server=target/release/examples/bench_server
work=$(mktemp -d)
cleanup() {
  if [ -n "${recorder:-}" ]; then kill "$recorder" 2>/dev/null || true; fi
  if [ -n "${pid:-}" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
paranoid=$(cat /proc/sys/kernel/perf_event_paranoid 2>/dev/null || echo 2)
if [ "$(id -u)" != 0 ] && [ "$paranoid" -gt 1 ]; then
  echo "warning: kernel.perf_event_paranoid is $paranoid and this is not root: perf samples user space only, the kernel's share is missing" >&2
fi
: > "$work/rounds"

read -r -a order <<< "$VARIANTS"
for round in $(seq "$ROUNDS"); do
  shift_by=$(( round % ${#order[@]} ))
  rotated=("${order[@]:shift_by}" "${order[@]:0:shift_by}")
  for variant in "${rotated[@]}"; do
    "$server" "$variant" "$PORT" >/dev/null &
    pid=$!
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 0.05; done
    data="$work/$variant.$round.data"
    perf record -q -e cpu-clock -F "$FREQ" -p "$pid" -o "$data" -- sleep "$DURATION" \
      >/dev/null 2>>"$work/perf.log" &
    recorder=$!
    served=$(wrk -t1 -c32 -d"${DURATION}s" "http://127.0.0.1:$PORT/" | awk '/requests in/ {print $1}') || true
    wait "$recorder" || true; recorder=
    kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=
    # The CPU time each function's samples stand for, in nanoseconds (perf's own sum,
    # not its rounded percentages).
    perf report -q -i "$data" --stdio --sort symbol --field-separator=$'\t' --show-total-period \
      2>>"$work/perf.log" > "$work/$variant.$round.report" || true
    if [ "${served:-0}" -le 0 ] || [ ! -s "$work/$variant.$round.report" ]; then
      echo "round $round $variant: no requests served or no samples; left out" >&2
      continue
    fi
    echo "$variant $served $work/$variant.$round.report" >> "$work/rounds"
    echo "round $round $variant: $served requests" >&2
  done
done

if [ -s "$work/perf.log" ]; then sort -u "$work/perf.log" | head -5 >&2; fi
python3 - "$work/rounds" "$TOP" "${order[@]}" <<'PY'
import collections, re, sys

rounds_path, top, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
served = collections.Counter()
nanos = collections.defaultdict(collections.Counter)
for line in open(rounds_path):
    variant, count, report = line.split()
    served[variant] += int(count)
    for row in open(report):
        cells = row.rstrip("\n").split("\t")
        if len(cells) < 3:
            continue
        try:
            period = int(cells[1].strip())
        except ValueError:
            continue
        # "[.] name" or "[k] name": the function, without the privilege mark.
        name = re.sub(r"^\[.\]\s+", "", cells[2].strip())
        nanos[variant][name] += period
if not served:
    sys.exit("no round served requests with samples: see the messages above")

def per_request(variant, name):
    return nanos[variant][name] / served[variant] if served[variant] else 0.0

print("| server | requests | sampled server CPU a request (µs) |")
print("|---|---|---|")
for variant in variants:
    if served[variant]:
        total = sum(nanos[variant].values()) / served[variant] / 1000
        print(f"| {variant} | {served[variant]:,} | {total:.2f} |")
if len([v for v in variants if served[v]]) < 2:
    sys.exit(0)
a, b = [v for v in variants if served[v]][:2]
short = lambda name: name if len(name) <= 110 else name[:107] + "..."
print()
print("The functions named for the limiters (ns of server CPU a request):")
print()
print(f"| function | {a} | {b} |")
print("|---|---|---|")
own = [name for name in set(nanos[a]) | set(nanos[b]) if "tollgate::" in name or "governor" in name]
own.sort(key=lambda name: -max(per_request(a, name), per_request(b, name)))
for name in own[:top]:
    print(f"| `{short(name)}` | {per_request(a, name):.0f} | {per_request(b, name):.0f} |")
print(f"| all of them | {sum(per_request(a, n) for n in own):.0f} | {sum(per_request(b, n) for n in own):.0f} |")
print()
print(f"The functions whose cost a request differs most, {b} less {a} (ns):")
print()
print(f"| function | {a} | {b} | difference |")
print("|---|---|---|---|")
names = set(nanos[a]) | set(nanos[b])
diffs = sorted(names, key=lambda name: -abs(per_request(b, name) - per_request(a, name)))
for name in diffs[:top]:
    x, y = per_request(a, name), per_request(b, name)
    print(f"| `{short(name)}` | {x:.0f} | {y:.0f} | {y - x:+.0f} |")
PY
