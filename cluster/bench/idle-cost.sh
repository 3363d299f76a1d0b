#!/usr/bin/env bash
# idle-cost.sh: what an idle seathold costs its Redis masters once many
# shows hold seats. Starts `seathold dev` (its own local cluster), makes
# single-seat holds of the default TTL (5 minutes) on random shows with wrk
# for LOAD seconds, then stops the load and measures, over IDLE seconds, the
# masters' CPU (user + system ticks in /proc, all three together, percent
# of one core) and the scripts they ran (EVALSHA calls): the sweeper's
# background work, as nothing is due yet.
#   cluster/bench/idle-cost.sh [--bin target/release/seathold]
# Settings from the environment: LOAD (15), IDLE (20), PORT (18091).
# Needs wrk, redis-cli and pgrep.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
bin=$here/../../target/release/seathold
if [[ "${1:-}" == --bin ]]; then bin=$2; fi
load=${LOAD:-15} idle=${IDLE:-20} port=${PORT:-18091}
# shellcheck source=cluster/bench/dev.sh
source "$here/dev.sh"
start_dev "$bin" "$port"
BENCH_RUN="idle$RANDOM" BENCH_SHOWS=1000000 \
  wrk -t2 -c50 -d"${load}s" -s "$here/hold1.lua" "http://127.0.0.1:$port" |
  awk -v d="$load" '/requests in/ { printf "load: %d holds in %d s on random shows\n", $1, d }'
sleep 2
shows=0
for p in "${masters[@]}"; do
  shows=$((shows + $(redis-cli -p "$p" --scan --pattern '*#deadlines' | wc -l)))
done
t0=$(master_ticks) s0=$(master_calls evalsha)
sleep "$idle"
t1=$(master_ticks) s1=$(master_calls evalsha)
hz=$(getconf CLK_TCK)
awk -v shows="$shows" -v t=$((t1 - t0)) -v hz="$hz" -v idle="$idle" -v s=$((s1 - s0)) 'BEGIN {
  printf "idle %d s with %d shows holding seats: masters %.2f%% of one core together, %.0f EVALSHA/s\n",
    idle, shows, 100 * t / hz / idle, s / idle }'
