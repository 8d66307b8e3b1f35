#!/usr/bin/env bash
# The README's test command: installs what the test suite needs when it is missing, then
# runs `cargo test --all-features --locked` (extra arguments are passed on to it).
#
# The Redis tests start their own redis-server processes (standalone servers, one with
# TLS; Clusters, one with replicas; a primary with a replica and three sentinels) on free
# loopback ports, so they need the redis-server, redis-cli and redis-sentinel binaries;
# without them they fail, they never skip. On a machine with apt-get this script installs
# them (as root, or through sudo); elsewhere it says what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

have_redis() {
  command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
    && command -v redis-sentinel >/dev/null 2>&1
}

if ! have_redis; then
  missing="redis-server, redis-cli and redis-sentinel (Debian/Ubuntu packages: redis-server redis-tools redis-sentinel)"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test.sh: the Redis tests need $missing; there is no apt-get here:" >&2
    echo "install them with your package manager, then run this again." >&2
    exit 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    as_root() { "$@"; }
  elif command -v sudo >/dev/null 2>&1; then
    as_root() { sudo "$@"; }
  else
    echo "scripts/test.sh: the Redis tests need $missing; installing them needs root" >&2
    echo "and there is no sudo: run 'apt-get install redis-server redis-tools redis-sentinel' as root." >&2
    exit 1
  fi
  # The services of the packages this script installs (not of those already there,
  # which may be a Redis the machine runs): stopped again below.
  brought=()
  for package in redis-server redis-sentinel; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
      brought+=("$package")
    fi
  done
  echo "scripts/test.sh: installing redis-server, redis-tools and redis-sentinel (apt-get)" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends redis-server redis-tools redis-sentinel >/dev/null
  if ! have_redis; then
    echo "scripts/test.sh: apt-get ran, but redis-server, redis-cli or redis-sentinel is still not on PATH" >&2
    exit 1
  fi
  # Under systemd the packages start their services and enable them at boot. The suite
  # runs servers of its own on free ports: the services of the packages this script
  # brought are stopped and disabled again, so nothing it installed keeps running.
  if [ "${#brought[@]}" -gt 0 ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    echo "scripts/test.sh: stopping and disabling the services it installed: ${brought[*]}" >&2
    as_root systemctl disable --now "${brought[@]}" >/dev/null 2>&1 || true
  fi
fi

# The suite tests Redis Functions (FCALL, FUNCTION LOAD, their ACL rules), which came in
# Redis 7.0; the library itself also runs on older servers (EVALSHA). Said here rather
# than as a dozen failing tests.
version=$(redis-server --version | sed -n 's/.*v=\([0-9][0-9]*\)\..*/\1/p')
if [ -z "$version" ] || [ "$version" -lt 7 ]; then
  echo "scripts/test.sh: the test suite needs Redis 7.0 or later; $(command -v redis-server) is" >&2
  echo "'$(redis-server --version)'. Debian 11 and Ubuntu 22.04 ship Redis 6: install a newer one" >&2
  echo "(https://redis.io/docs/latest/operate/oss_and_stack/install/) and put it first on PATH." >&2
  exit 1
fi

exec cargo test --all-features --locked "$@"
