#!/usr/bin/env bash
# daemon-cost.sh: the instructions seathold itself executes per single-seat
# hold (HTTP, JSON, the Redis client, metrics, ...), counted by valgrind's
# callgrind, for one or more builds side by side. Timings on a shared
# 2-core machine spread by 15% from run to run, more than most changes to
# the daemon; the count of one build repeats within about 1%.
#
# Each build runs as `BIN dev` under callgrind with instrumentation off
# while the cluster starts; then wrk sends single-seat holds
# (cluster/bench/hold1.lua, 10 connections, 1 thread) for DURATION with
# instrumentation on, and the instructions of that window (every thread of
# the daemon, its background tasks too) are divided by the answers.
#   cluster/bench/daemon-cost.sh BIN [BIN ...]
# Settings: DURATION (seconds, default 20), SHOWS (default 0: one hot
# show; as in ab.sh), PORT (default 18094), STEP (hold1, the default, or
# storm: holds of 100 seats of one show that are held beforehand, all
# refused with 409, most by the local seat view, as in bench.sh's storm
# step; the first 5 s are not counted, so that the view is in place). Prints one line per build, and the top
# functions (self instructions) with TOP=N; KEEP=1 keeps the callgrind
# files (callgrind_annotate --inclusive=yes / --tree=caller read them).
# Needs valgrind (callgrind_control, callgrind_annotate), wrk, curl and
# redis-server. The count is of user-space instructions: the kernel's
# network work (about 40% of the daemon's CPU, `perf record`) is not in it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
for tool in valgrind callgrind_control callgrind_annotate wrk curl redis-server; do
  command -v "$tool" >/dev/null || {
    echo "daemon-cost.sh needs $tool (apt-get install valgrind wrk curl redis-server)" >&2
    exit 1
  }
done
(($#)) || {
  echo "usage: cluster/bench/daemon-cost.sh BIN [BIN ...]" >&2
  exit 1
}
secs=${DURATION:-20}
shows=${SHOWS:-0}
port=${PORT:-18094}
top=${TOP:-0}
step=${STEP:-hold1}
work=$(mktemp -d)
pid=
stop() {
  if [[ -n "$pid" ]]; then
    kill -INT "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  if [[ -n "${KEEP:-}" ]]; then
    echo "kept $work" >&2
  else
    rm -rf "$work"
  fi
}
trap stop EXIT

for bin in "$@"; do
  rm -f "$work"/cg.out*
  SEATHOLD_LOG=warn valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$work/cg.out" "$bin" dev --listen "127.0.0.1:$port" \
    >"$work/dev.out" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
    sleep 0.2
  done
  curl -fs "http://127.0.0.1:$port/readyz" >/dev/null || {
    echo "$bin did not start under valgrind: $(tail -n 20 "$work/dev.out")" >&2
    exit 1
  }
  run="dc$RANDOM" script=hold1.lua expect=201
  if [[ "$step" == storm ]]; then
    script=storm.lua expect=409
    for i in $(seq 100); do
      curl -fs -o /dev/null -X POST -H 'Content-Type: application/json' -d '{"ttlMs":1200000}' \
        "http://127.0.0.1:$port/v1/shows/$run-hot/seats/h$i/hold"
    done
    BENCH_RUN=$run wrk -t1 -c10 -d5s -s "$here/$script" "http://127.0.0.1:$port" >/dev/null
  fi
  callgrind_control -i on "$pid" >/dev/null
  line=$(BENCH_RUN=$run BENCH_SHOWS=$shows BENCH_EXPECT=$expect \
    wrk -t1 -c10 -d"${secs}s" -s "$here/$script" "http://127.0.0.1:$port" | grep '^BENCH')
  callgrind_control -i off "$pid" >/dev/null
  kill -INT "$pid"
  wait "$pid" 2>/dev/null || true
  pid=
  answers=$(tr '\t' '\n' <<<"$line" | grep '^requests=' | cut -d= -f2)
  not_ok=$(tr '\t' '\n' <<<"$line" | grep '^not_ok=' | cut -d= -f2)
  # every thread's file (one per thread with --separate-threads, else one)
  total=0
  for f in "$work"/cg.out*; do
    n=$(grep -m1 '^totals:' "$f" | awk '{print $2}')
    total=$((total + ${n:-0}))
  done
  awk -v bin="$bin" -v expect="$expect" -v total="$total" -v n="$answers" -v bad="$not_ok" 'BEGIN {
    printf "%s  answers %d  not %d %d  instructions per answer %.0f\n", bin, n, expect, bad, total / (n > 0 ? n : 1)
  }'
  if ((top)); then
    callgrind_annotate "$work"/cg.out* 2>/dev/null | sed -n '/^Ir/,$p' | sed -n "3,$((top + 2))p"
  fi
done
