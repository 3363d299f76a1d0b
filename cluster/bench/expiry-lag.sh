#!/usr/bin/env bash
# expiry-lag.sh: how late `expired` events are while an on-sale goes on.
# Starts `seathold dev` (its own local cluster), makes single-seat holds of
# TTL_MS on random shows with wrk for DURATION seconds, waits for them to
# run out, then reads the event streams of up to STREAMS shows per master
# straight from Redis and prints how late each `expired` event was: its
# stream id's time minus the hold's expiry (the entry's `x` field), both
# Redis's clock.
#   cluster/bench/expiry-lag.sh [--bin target/release/seathold]
# Settings from the environment: TTL_MS (2000), DURATION (10), STREAMS
# (1500), CONNECTIONS (50), PORT (18090). Needs wrk and redis-cli.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
bin=$here/../../target/release/seathold
if [[ "${1:-}" == --bin ]]; then bin=$2; fi
ttl=${TTL_MS:-2000} duration=${DURATION:-10} streams=${STREAMS:-1500}
connections=${CONNECTIONS:-50} port=${PORT:-18090}
# shellcheck source=cluster/bench/dev.sh
source "$here/dev.sh"
start_dev "$bin" "$port"

ttl_hold_lua "$ttl"
echo "holds of $ttl ms on random shows, $connections connections, ${duration} s:"
BENCH_RUN="lag$RANDOM" BENCH_SHOWS=1000000 \
  wrk -t2 -c"$connections" -d"${duration}s" -s "$work/hold.lua" "http://127.0.0.1:$port" |
  awk -v d="$duration" '/requests in/ { printf "  %d holds, %.0f/s\n", $1, $1 / d }'
# The last holds run out TTL_MS after the load stops; then a little more.
sleep $((ttl / 1000 + 3))
curl -fs "http://127.0.0.1:$port/metrics" |
  awk '/^seathold_holds_total |^seathold_hold_expiries_total / { printf "  %s %s\n", $1, $2 }'
# Sweeps: sweep.lua calls TIME once a run; nothing else on this path does,
# but a scan of the masters, once per page that finds deadline indexes.
echo "  sweeps (TIME calls on the masters): $(master_calls time)"

# head closes the SCAN early (SIGPIPE): not a failure here.
set +o pipefail
for p in "${masters[@]}"; do
  redis-cli -p "$p" --scan --pattern '*#events' | head -n "$streams" | while read -r key; do
    redis-cli -p "$p" xrange "$key" - + </dev/null
  done
done | awk '/^[0-9]+-[0-9]+$/ { split($0, id, "-"); ms = id[1]; t = ""; prev = ""; next }
  prev == "t" { t = $0 }
  prev == "x" && t == "expired" { print ms - $0 }
  { prev = $0 }' | sort -n |
  awk '{ a[NR] = $1 } END {
    if (NR == 0) { print "no expired events found"; exit 1 }
    printf "  %d expired events read back; late by p50 %d ms, p99 %d ms, max %d ms\n",
      NR, a[int((NR - 1) * 0.5) + 1], a[int((NR - 1) * 0.99) + 1], a[NR] }'
