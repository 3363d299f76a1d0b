#!/usr/bin/env bash
# lua-cost.sh: Redis's CPU per EVALSHA of lua/hold.lua (a single-seat hold),
# with events on and off, for holds of one show and of a new show each time,
# next to a raw SET NX PX; on one throwaway redis-server, with
# redis-benchmark (50 connections). CPU per call is INFO cpu (user + sys)
# over the run divided by the calls: it includes the server's network work,
# as the raw SET's does; "inside" is the time the command itself took
# (INFO commandstats usec_per_call of EVALSHA, or of SET for the raw SET),
# without the network work. The line "five bare calls" is a script that
# makes the five calls of an events-on hold (SET NX PX, PEXPIRETIME, XADD,
# SET NX PX, ZADD) with constant arguments and nothing else: the least any
# script with those five calls costs (before 2026-12-03 hold.lua made four,
# without PEXPIRETIME, and so did this line, "four bare calls"). Redis settings can follow the file, e.g.
#   cluster/bench/lua-cost.sh [HOLD_LUA] [-- --stream-node-max-bytes 1024]
# With COUNT=1 the server runs under valgrind's callgrind and each line
# gives the instructions the server executed per call instead (N defaults
# to 5000 then): the same count on every run of the same build, whatever
# else the machine does, where the CPU times vary by 10-20% from run to run.
# Needs redis-server, redis-cli, redis-benchmark and bc (and valgrind with
# COUNT=1).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
lua=${1:-$here/../../lua/hold.lua}
shift $(($# > 0 ? 1 : 0))
[[ "${1:-}" != -- ]] || shift
port=${PORT:-7999}
count=${COUNT:-0}
if ((count)); then n=${N:-5000}; else n=${N:-200000}; fi
rounds=${ROUNDS:-2}

cli() { redis-cli -p "$port" "$@"; }
cli shutdown nosave >/dev/null 2>&1 || true
dir=$(mktemp -d)
trap 'cli shutdown nosave >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
if ((count)); then
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" redis-server --port "$port" \
    --save '' --appendonly no --dir "$dir" "$@" >"$dir/redis.log" 2>&1 &
  server=$!
else
  redis-server --port "$port" --save '' --appendonly no --daemonize yes \
    --dir "$dir" --logfile "$dir/redis.log" "$@" >/dev/null
fi
for _ in $(seq 100); do cli ping >/dev/null 2>&1 && break; sleep 0.2; done

cpu() { cli info cpu | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { print s }'; }
dumps=0
# bench NAME ARGS...: one redis-benchmark run of ARGS on an emptied server.
bench() {
  local name=$1 t0 t1 rate
  shift
  cli flushall >/dev/null
  if ((count)); then
    callgrind_control -z "$server" >/dev/null 2>&1
    redis-benchmark -p "$port" -c 50 -n "$n" -r 1000000000 "$@" >/dev/null
    # callgrind dumps what it counted since the -z to cg.out.<n>
    callgrind_control -d "$server" >/dev/null 2>&1
    dumps=$((dumps + 1))
    printf '%-22s %9d instructions per call\n' "$name" \
      $(($(awk '/^summary:/ { print $2 }' "$dir/cg.out.$dumps") / n))
    return
  fi
  cli config resetstat >/dev/null
  t0=$(cpu)
  rate=$(redis-benchmark -p "$port" -c 50 -n "$n" -r 1000000000 --csv "$@" | tail -n 1 | awk -F'"' '{ print int($4) }')
  t1=$(cpu)
  inside=$(cli info commandstats | awk -F'[:,=]' -v c="cmdstat_$(echo "$1" | tr '[:upper:]' '[:lower:]')" \
    '$1 == c { for (i = 2; i < NF; i++) if ($i == "usec_per_call") print $(i + 1) }')
  printf '%-22s %9s/s %8.1f us per call, %5.1f us inside\n' "$name" "$rate" \
    "$(echo "($t1 - $t0) * 1000000 / $n" | bc -l)" "${inside:-0}"
}

sha=$(cli script load "$(cat "$lua")")
bare=$(cli script load "redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2])
redis.call('PEXPIRETIME', KEYS[2])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', '10000', '*', 't', 'held', 'r', 'x', 's', 'E7', 'l', ARGV[2])
redis.call('SET', KEYS[1], 'x', 'NX', 'PX', ARGV[2])
redis.call('ZADD', KEYS[3], '1', 'x')
return 1")
token=0e0a8b44-1b7c-4f0e-9d7a-3c2c59d6a111
ref=0123456789abcdef
# hold.lua's short form for one seat, no pool, no holder, no idempotency
# key: token, ttl, events on (1) or off (0), kind and items, ref, seat, cap.
on=("$token" 300000 1 's x/E7' "$ref" E7 10000)
off=("$token" 300000 0 's x/E7' "$ref" E7 10000)
# four seats of one show, events on: token, ttl, F, kind, items,
# fingerprint, idempotency ttl, E, cap, ref, S, P, H, holder limit, then
# the show's items
on4=("$token" 300000 0 s 'x/A x/B x/C x/D' '' 86400000 1 10000 "$ref" 4 0 0 0 'A B C D')
echo "EVALSHA of $lua, $n calls per line, redis $(redis-server --version | awk '{ print $3 }')"
for ((r = 1; r <= rounds; r++)); do
  bench "raw SET NX PX" SET 'k:{s__rand_int__}:E7' "$token" NX PX 300000
  bench "five bare calls" EVALSHA "$bare" 4 'h:{s1}:hold:__rand_int__' 'h:{s1}:E__rand_int__' \
    'h:{s1}#deadlines' 'h:{s1}#events' "$token" 300000
  bench "events on, one show" EVALSHA "$sha" 4 'h:{s1}:hold:__rand_int__' 'h:{s1}:E__rand_int__' \
    'h:{s1}#deadlines' 'h:{s1}#events' "${on[@]}"
  bench "events on, new shows" EVALSHA "$sha" 4 'h:{s__rand_int__}:hold:x' 'h:{s__rand_int__}:E7' \
    'h:{s__rand_int__}#deadlines' 'h:{s__rand_int__}#events' "${on[@]}"
  bench "events off, one show" EVALSHA "$sha" 3 'h:{s1}:hold:__rand_int__' 'h:{s1}#fence' \
    'h:{s1}:E__rand_int__' "${off[@]}"
  bench "events off, new shows" EVALSHA "$sha" 3 'h:{s__rand_int__}:hold:x' 'h:{s__rand_int__}#fence' \
    'h:{s__rand_int__}:E7' "${off[@]}"
  bench "4 seats, events on" EVALSHA "$sha" 7 'h:{s1}:hold:__rand_int__' 'h:{s1}:A__rand_int__' \
    'h:{s1}:B__rand_int__' 'h:{s1}:C__rand_int__' 'h:{s1}:D__rand_int__' 'h:{s1}#deadlines' \
    'h:{s1}#events' "${on4[@]}"
done
