#!/usr/bin/env bash
# two-instances.sh: what expiries cost the masters with two instances.
# Starts `seathold dev` (its own local cluster) and a second instance
# (`seathold serve`) on the same cluster, makes single-seat holds of TTL_MS
# on random shows with wrk on the first for DURATION seconds, waits for them
# to run out, and prints the holds, the expiries each instance wrote, the
# runs of sweep.lua and the reads of deadlines the instances made, and the
# masters' CPU over that time (from /proc). Every instance hears every
# expiry; the hold's own instance sweeps it, the other only reads.
#   cluster/bench/two-instances.sh [--bin target/release/seathold]
# Settings from the environment: TTL_MS (2000), DURATION (8), CONNECTIONS
# (20), PORT (18095). Needs wrk, redis-cli and curl.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
bin=$here/../../target/release/seathold
if [[ "${1:-}" == --bin ]]; then bin=$2; fi
ttl=${TTL_MS:-2000} duration=${DURATION:-8} connections=${CONNECTIONS:-20}
port=${PORT:-18095}
# shellcheck source=cluster/bench/dev.sh
source "$here/dev.sh"
start_dev "$bin" "$port"

second=$((port + 1))
nodes=$(printf 'redis://127.0.0.1:%s,' "${masters[@]}")
SEATHOLD_LOG=warn "$bin" serve --listen "127.0.0.1:$second" --redis-nodes "${nodes%,}" \
  >"$work/second.out" 2>&1 &
second_pid=$!
trap 'kill -INT "$second_pid" 2>/dev/null || true; wait "$second_pid" 2>/dev/null || true; stop_dev' EXIT
wait_ready "$second"

metric() {
  curl -fs "http://127.0.0.1:$1/metrics" | awk -v m="$2" '$1 == m { print $2 }'
}

ttl_hold_lua "$ttl"
evalsha0=$(master_calls evalsha) zrange0=$(master_calls zrange) ticks0=$(master_ticks)
echo "holds of $ttl ms on random shows, made on one of two instances, $connections connections, ${duration} s:"
BENCH_RUN="two$RANDOM" BENCH_SHOWS=1000000 \
  wrk -t2 -c"$connections" -d"${duration}s" -s "$work/hold.lua" "http://127.0.0.1:$port" >/dev/null
sleep $((ttl / 1000 + 4))
evalsha=$(($(master_calls evalsha) - evalsha0)) zrange=$(($(master_calls zrange) - zrange0))
cpu=$(($(master_ticks) - ticks0))
holds=$(metric "$port" seathold_holds_total)
holds=${holds%.*}
# Every EVALSHA is a hold or a sweep; every sweep calls ZRANGE once.
sweeps=$((evalsha - holds))
echo "  holds: $holds; expiries written: $(metric "$port" seathold_hold_expiries_total) (first instance) + $(metric "$second" seathold_hold_expiries_total) (second)"
echo "  runs of sweep.lua: $sweeps; reads of deadlines (ZRANGE beyond the sweeps' own): $((zrange - sweeps))"
awk -v t="$cpu" -v hz="$(getconf CLK_TCK)" -v h="$holds" 'BEGIN {
  printf "  masters: %.2f s of CPU, %.0f us per hold with its expiry\n", t / hz, t / hz / h * 1e6 }'
