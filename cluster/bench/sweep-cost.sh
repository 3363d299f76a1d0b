#!/usr/bin/env bash
# sweep-cost.sh: Redis's time per run of lua/sweep.lua (one due hold per
# run, so one `expired` event each), of this checkout against the script
# at git revision REV, side by side on one throwaway redis-server: N runs
# with redis-benchmark (one connection) per version and round, INFO
# commandstats usec_per_call of EVALSHA, and the median of the rounds.
#   cluster/bench/sweep-cost.sh REV        e.g. cluster/bench/sweep-cost.sh 6f779f8
# Settings from the environment: N (50000), ROUNDS (6), PORT (7998).
# The two versions are called with the arguments each one takes: the old
# one's header must name the same KEYS (index, stream) and at most the
# ARGV given here (stream cap, batch, then a run id and "" if it takes them).
set -euo pipefail

rev=${1:?usage: sweep-cost.sh REV}
here=$(cd "$(dirname "$0")" && pwd)
root=$here/../..
port=${PORT:-7998} n=${N:-50000} rounds=${ROUNDS:-6}
work=$(mktemp -d)
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" show "$rev:lua/sweep.lua" >"$work/old.lua"
cp "$root/lua/sweep.lua" "$work/new.lua"
redis-server --port "$port" --save "" --appendonly no --daemonize yes \
  --logfile "$work/redis.log" --dir "$work"
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
cli() { redis-cli -p "$port" "$@"; }
for round in $(seq "$rounds"); do
  for v in old new; do
    cli flushall >/dev/null
    cli config resetstat >/dev/null
    # n holds due long ago, one per run
    cli eval "for i=1,tonumber(ARGV[1]) do redis.call('ZADD', KEYS[1], 1, 'r'..i..' 1000 A'..i) end" \
      1 idx "$n" >/dev/null
    sha=$(cli script load "$(cat "$work/$v.lua")")
    args=(10000 1)
    grep -q 'ARGV\[3\]' "$work/$v.lua" && args+=(__rand_int__ "")
    redis-benchmark -p "$port" -n "$n" -c 1 -r 100000000 -q EVALSHA "$sha" 2 idx stream "${args[@]}" >/dev/null
    [[ $(cli zcard idx) == 0 ]] || { echo "the $v script left holds unswept" >&2; exit 1; }
    us=$(cli info commandstats | sed -nE 's/^cmdstat_evalsha:.*usec_per_call=([0-9.]+).*/\1/p')
    echo "round $round $v: $us us per run"
    echo "$us" >>"$work/$v.us"
  done
done
for v in old new; do
  sort -n "$work/$v.us" | awk -v v="$v" '{a[NR] = $1} END {
    m = NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
    printf "%s: median %.2f us per run\n", v, m }'
done
