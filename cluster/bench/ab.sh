#!/usr/bin/env bash
# ab.sh: two seathold builds side by side, in alternating runs: each run
# starts a fresh `BIN dev` (cluster and daemon), sends single-seat holds
# with wrk (cluster/bench/hold1.lua, 50 connections, 2 threads) for
# SECONDS, and prints the answers, p50, p99, slowest answer, and the CPU
# per answer of the daemon and of the three masters (user + system, from
# /proc: less noisy than the answers, which follow whatever else the two
# cores do). The order alternates (A B, B A, ...), as this machine's speed
# drifts by minutes.
#   cluster/bench/ab.sh BIN_A BIN_B [RUNS [SECONDS [SHOWS]]]
# SHOWS: distinct shows to draw from (default 1000000000: nearly every hold
# on a new show; 0: one hot show). Defaults: 5 runs of 20 s each.
# With RATE=N in the environment, the holds are offered at N per second by
# cluster/bench/paced.rs (open loop) instead of as fast
# as wrk can, and p50/p99/slowest count from when each request was due;
# PACED names its binary (default target/release/examples/paced), and
# ARRIVALS=poisson spaces the holds at random (default: even).
# Needs wrk (or paced), curl, redis-server.
set -euo pipefail

a=$1 b=$2 runs=${3:-5} secs=${4:-20} shows=${5:-1000000000}
here=$(cd "$(dirname "$0")" && pwd)
rate=${RATE:-}
arrivals=${ARRIVALS:-even}
paced=${PACED:-$here/../../target/release/examples/paced}
if [[ -n "$rate" && ! -x "$paced" ]]; then
  echo "ab.sh: RATE needs $paced (cargo build --release --example paced)" >&2
  exit 2
fi
# shellcheck source=cluster/bench/dev.sh
source "$here/dev.sh"

# CPU ticks (user + system) of one process
ticks() {
  local fields
  read -r -a fields <"/proc/$1/stat"
  echo $((fields[13] + fields[14]))
}

one() {
  local name=$1 bin=$2 line d0 d1 m0 m1
  start_dev "$bin" 18093
  d0=$(ticks "$dev_pid") m0=$(master_ticks)
  if [[ -n "$rate" ]]; then
    # No warm-up, as with wrk: the CPU measured is that of the answers counted.
    line=$("$paced" --addr 127.0.0.1:18093 --rate "$rate" --arrivals "$arrivals" --duration "$secs" --warmup 0 \
      --shows "$shows" --run "ab$RANDOM" | grep '^BENCH')
  else
    line=$(BENCH_RUN="ab$RANDOM" BENCH_SHOWS=$shows BENCH_EXPECT=201 \
      wrk -t2 -c50 -d"${secs}s" -s "$here/hold1.lua" http://127.0.0.1:18093 | grep '^BENCH')
  fi
  d1=$(ticks "$dev_pid") m1=$(master_ticks)
  kill -INT "$dev_pid" 2>/dev/null || true
  wait "$dev_pid" 2>/dev/null || true
  dev_pid=
  awk -v name="$name" -v hz="$(getconf CLK_TCK)" -v daemon=$((d1 - d0)) -v master=$((m1 - m0)) -F'\t' '{
    for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
    n = v["requests"] > 0 ? v["requests"] : 1
    printf "%s  answers %8d  not 201 %d  p50 %6.2f ms  p99 %6.2f ms  slowest %7.2f ms  us/answer: daemon %5.1f  masters %5.1f\n",
      name, v["requests"], v["not_ok"], v["p50_us"] / 1000, v["p99_us"] / 1000, v["max_us"] / 1000,
      daemon * 1e6 / hz / n, master * 1e6 / hz / n
  }' <<<"$line"
}

for ((r = 1; r <= runs; r++)); do
  if ((r % 2)); then
    one A "$a"
    one B "$b"
  else
    one B "$b"
    one A "$a"
  fi
done
