#!/usr/bin/env bash
# Benchmark seathold against raw Redis on fresh local Redis Clusters.
# Run `cluster/bench.sh --help` for what it measures and how.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: cluster/bench.sh [options]

Starts `seathold dev` (a fresh local Redis Cluster plus the daemon, all on
127.0.0.1) and measures, in one run and side by side:

  raw   redis-benchmark --cluster: SET seat-hold:{tag}:<rand> <36-byte token> NX PX 300000
  hold1 POST /v1/shows/{show}/seats/{seat}/hold (no body), random show and seat
  hold4 POST /v1/shows/{show}/holds {"seats":[4 random seats]}, random show
  hot1  single-seat holds that all go to one hot show (one slot, one master)
  hot4  four-seat holds that all go to one hot show
  read  GET /v1/shows/{show}/seats/{seat}, random show, free seat
  storm a conflict storm: single-seat holds of 100 seats of one hot show
        that are all held already (held with curl before the step, TTL
        20 min), every answer 409; also how many of the refusals reached no
        Redis master (the masters' evalsha calls, and the daemon's
        seathold_view_answers_total{kind="conflict"}: its seat view)
  hotread GET /v1/shows/{show}/seats/{seat} of those 100 held seats of one
        hot show, every answer 200 (seathold_view_answers_total{kind="read"})
  pool1 POST /v1/shows/{show}/holds {"pools":{"coupons":1}}: one unit each of
        one hot pool (created with a PUT before the step, capacity 100000000)

then a latency table: hold1, hot1, hold4 and hot4 at a fixed offered rate
(cluster/bench/paced.rs, open loop: each request is due at its time whether
or not earlier ones were answered, and its latency counts from then) of
25%, 50% and 75% of the holds/s wrk reached in the same round; wrk keeps
every connection busy, so its own latency is the connections divided by
the throughput (Little's law) and says little about a daemon that is not
saturated. Then a growth table (N-seat holds for N = 1 2 4 8 16 20 over /holds),
single-seat holds on a fresh 1-master cluster versus a fresh 3-master
cluster, and single-seat holds (random shows, one hot show) and four-seat
holds with event streams off (`--events off`) and on, side by side: two
daemons on one cluster, each step measured on both in turn in every round
(on/off = the ratio of their holds/s in that round; with random shows
every hold starts a new stream, which a real show does once). Each step is
warmed up briefly first; then every master is
emptied (FLUSHALL), so that every measurement, raw included, starts from an
empty keyspace. Every HTTP response is
counted by status; a step with any answer other than its expected one (201
for holds, 200 for reads, 409 for the storm), or with socket errors, is
reported as INVALID instead of as a speed. A table gives the Redis masters'
CPU per operation of each main step (per granted hold, per refusal, per
read) next to their CPU per raw SET.
Shows are drawn from a million per step ("<run>-<n>"); seat ids never repeat
within a step, so no hold should ever conflict.

Options:
  -d, --duration SECONDS   measured time per step (default 10)
  -w, --warmup SECONDS     warm-up time before each step (default 2)
  -q, --quick              smoke run: 3 s per step, 1 s warm-up, 1 round
  -n, --rounds N           rounds of the side-by-side section: each round
                           measures raw SET and then every seathold step, and
                           each step's ratio is to the raw SET/s of its own
                           round; the table shows the median round (default 3)
  -c, --connections N      concurrent connections, both tools (default 50)
  -t, --threads N          wrk threads and redis-benchmark threads (default 2)
  -r, --replicas N         replicas per master in every cluster (default 1)
      --retries N          measure a step again, up to N more times, when
                           other processes took over 20% of one core during
                           it, and keep the quietest attempt (default 2)
      --wait-idle SECONDS  before each step, wait up to this long for the rest
                           of the machine to go quiet (below 25% of one core
                           busy besides our own cluster) (default 0: don't)
      --sections LIST      comma-separated subset of main,growth,masters,events,
                           latency (default: all five)
  -o, --out FILE           machine-readable results (TSV) go here
                           (default: a new file in ${TMPDIR:-/tmp})
      --bin PATH           use this seathold binary instead of building
                           target/release/seathold with `cargo build --release`
      --paced PATH         the latency section's load generator (default:
                           target/release/examples/paced, built with
                           `cargo build --release --example paced`)
      --arrivals KIND      how the latency section spaces its requests: even
                           (every 1/rate, the default) or poisson (random
                           gaps of mean 1/rate, as independent customers
                           arrive, bursts included)
  -h, --help               this text

Needs wrk, redis-benchmark, redis-cli, redis-server and curl on PATH
(Debian/Ubuntu: sudo apt-get install wrk redis-tools redis-server curl).
Nothing is pinned: clients, daemon and every redis-server share the machine's
cores, so the CPU table says where the time went (percent of one core;
"other" is whatever else ran on the machine meanwhile).
EOF
}

# ---------------------------------------------------------------- options

duration=10
warmup=2
connections=50
threads=2
replicas=1
sections="main,growth,masters,events,latency"
wait_idle=0
retries=2
rounds=3
out=""
bin=""
paced=""
arrivals=even

die() { echo "bench.sh: $*" >&2; exit 2; }
need_arg() { [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    -d|--duration) need_arg "$@"; duration=$2; shift 2 ;;
    -w|--warmup) need_arg "$@"; warmup=$2; shift 2 ;;
    -q|--quick) duration=3; warmup=1; rounds=1; shift ;;
    -c|--connections) need_arg "$@"; connections=$2; shift 2 ;;
    -t|--threads) need_arg "$@"; threads=$2; shift 2 ;;
    -r|--replicas) need_arg "$@"; replicas=$2; shift 2 ;;
    --sections) need_arg "$@"; sections=$2; shift 2 ;;
    --wait-idle) need_arg "$@"; wait_idle=$2; shift 2 ;;
    --retries) need_arg "$@"; retries=$2; shift 2 ;;
    -n|--rounds) need_arg "$@"; rounds=$2; shift 2 ;;
    -o|--out) need_arg "$@"; out=$2; shift 2 ;;
    --bin) need_arg "$@"; bin=$2; shift 2 ;;
    --paced) need_arg "$@"; paced=$2; shift 2 ;;
    --arrivals) need_arg "$@"; arrivals=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
if ! is_uint "$duration" || ((duration < 1)); then die "--duration must be a whole number of seconds >= 1"; fi
is_uint "$warmup" || die "--warmup must be a whole number of seconds"
[[ "$arrivals" == even || "$arrivals" == poisson ]] || die "--arrivals must be even or poisson"
if ! is_uint "$connections" || ((connections < 1)); then die "--connections must be >= 1"; fi
if ! is_uint "$threads" || ((threads < 1)); then die "--threads must be >= 1"; fi
((connections >= threads)) || die "--connections must be at least --threads (wrk needs one per thread)"
is_uint "$replicas" || die "--replicas must be a whole number"
is_uint "$wait_idle" || die "--wait-idle must be a whole number of seconds"
is_uint "$retries" || die "--retries must be a whole number"
if ! is_uint "$rounds" || ((rounds < 1)); then die "--rounds must be >= 1"; fi
for s in ${sections//,/ }; do
  case "$s" in main|growth|masters|events|latency) ;; *) die "unknown section '$s' (main, growth, masters, events, latency)" ;; esac
done
has_section() { [[ ",$sections," == *",$1,"* ]]; }

# ---------------------------------------------------------------- tools

missing=()
for tool in wrk redis-benchmark redis-cli redis-server curl awk; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  echo "bench.sh: missing on PATH: ${missing[*]}" >&2
  cat >&2 <<'EOF'
Install them, e.g. on Debian/Ubuntu:
  sudo apt-get install wrk redis-tools redis-server curl
(redis-benchmark and redis-cli come with redis-tools; on macOS: brew install wrk redis)
EOF
  exit 2
fi

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
lua_dir="$script_dir/bench"
for f in common.lua hold1.lua holds.lua read.lua storm.lua hotread.lua pool1.lua; do
  [[ -f "$lua_dir/$f" ]] || die "missing $lua_dir/$f"
done

if [[ -z "$bin" ]]; then
  command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust (https://rustup.rs) or pass --bin PATH"
  echo "building seathold (cargo build --release)..." >&2
  (cd "$repo" && cargo build --release --quiet) || die "cargo build --release failed"
  bin="$repo/target/release/seathold"
fi
[[ -x "$bin" ]] || die "seathold binary $bin is missing or not executable"
if has_section latency && [[ -z "$paced" ]]; then
  # Built like the daemon: cargo rebuilds it only when its source changed.
  command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust (https://rustup.rs) or pass --paced PATH"
  echo "building the latency section's load generator (cargo build --release --example paced)..." >&2
  (cd "$repo" && cargo build --release --quiet --example paced) || die "cargo build --release --example paced failed"
  paced="$repo/target/release/examples/paced"
fi
! has_section latency || [[ -x "$paced" ]] || die "load generator $paced is missing or not executable"

work=$(mktemp -d "${TMPDIR:-/tmp}/seathold-bench.XXXXXX")
if [[ -z "$out" ]]; then
  out="$work/results.tsv"
  keep_work=1
else
  keep_work=0
  : >"$out" || die "cannot write $out"
fi

clk_tck=$(getconf CLK_TCK)
ncpu=$(getconf _NPROCESSORS_ONLN)
run_id="b$(date +%s)$$"

# ---------------------------------------------------------------- daemon

daemon_pid=""
daemon_log=""
url=""
master_ports=()
replica_ports=()
master_pids=()
replica_pids=()

# Stops the daemon: SIGINT, then wait for it to exit (it stops its Redis
# Cluster and removes the folder on the way out); SIGKILL after 30 s (its
# watchdogs then kill the redis-servers).
# stop_second: stops the daemon start_second started, if it runs.
stop_second() {
  [[ -n "$second_pid" ]] || return 0
  local pid=$second_pid i
  second_pid=""
  kill -INT "$pid" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

stop_daemon() {
  stop_second
  [[ -n "$daemon_pid" ]] || return 0
  local pid=$daemon_pid i p
  daemon_pid=""
  if kill -0 "$pid" 2>/dev/null; then
    kill -INT "$pid" 2>/dev/null || true
    for ((i = 0; i < 300; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "bench.sh: seathold (pid $pid) did not stop within 30 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || true
  # Make sure its redis-servers are gone before the next cluster starts.
  for p in "${master_pids[@]}" "${replica_pids[@]}"; do
    for ((i = 0; i < 100; i++)); do
      kill -0 "$p" 2>/dev/null || break
      sleep 0.1
    done
  done
}

client_pid=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n "$client_pid" ]]; then kill -TERM "$client_pid" 2>/dev/null || true; fi
  stop_daemon
  ((rc == 0)) || echo "bench.sh: stopped early (exit $rc); daemon and its cluster are stopped" >&2
  if ((keep_work)); then
    # Keep only the results file.
    find "$work" -mindepth 1 ! -name results.tsv -delete 2>/dev/null || true
  else
    rm -rf "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_daemon MASTERS [DEV_ARGS...]: starts `seathold dev` and waits for /readyz.
start_daemon() {
  local masters=$1
  shift
  daemon_log="$work/daemon-$masters-$(date +%s%N).log"
  SEATHOLD_LOG=warn "$bin" dev --listen 127.0.0.1:0 --masters "$masters" --replicas "$replicas" "$@" \
    </dev/null >"$daemon_log" 2>&1 &
  daemon_pid=$!
  await_daemon "$daemon_pid" "$daemon_log" 's/^seathold is serving on \(http:\/\/[^ ]*\).*/\1/p' \
    "seathold dev" 90
  url=$ready_url
  local nodes port role pid
  nodes=$(sed -n 's/^Redis Cluster nodes: //p' "$daemon_log" | head -n 1)
  redis_nodes=$nodes
  master_ports=()
  replica_ports=()
  master_pids=()
  replica_pids=()
  for port in $(tr ',' '\n' <<<"$nodes" | sed 's/.*:\([0-9]*\)$/\1/'); do
    role=$(redis-cli -h 127.0.0.1 -p "$port" role | head -n 1)
    pid=$(redis-cli -h 127.0.0.1 -p "$port" info server | tr -d '\r' | sed -n 's/^process_id://p')
    if [[ "$role" == master ]]; then
      master_ports+=("$port")
      master_pids+=("$pid")
    else
      replica_ports+=("$port")
      replica_pids+=("$pid")
    fi
  done
  ((${#master_ports[@]} == masters)) || die "expected $masters masters, found ${#master_ports[@]} ($nodes)"
  echo "cluster: $masters master(s) + $((masters * replicas)) replica(s), seathold at $url (pid $daemon_pid)" >&2
}

# await_daemon PID LOG SED WHAT SECONDS: waits until the daemon PID has
# written its URL to LOG (the sed expression SED prints it) and its /readyz
# answers 200, and sets ready_url; dies, showing LOG, if PID exits first or
# SECONDS pass.
ready_url=""
await_daemon() {
  local pid=$1 log=$2 expr=$3 what=$4 limit=$5
  local deadline=$((SECONDS + limit))
  ready_url=""
  while [[ -z "$ready_url" ]]; do
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; die "$what exited during start-up"; }
    ((SECONDS < deadline)) || { cat "$log" >&2; die "$what did not start within $limit s"; }
    ready_url=$(sed -n "$expr" "$log" | head -n 1)
    [[ -n "$ready_url" ]] || sleep 0.2
  done
  until [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$ready_url/readyz" || true)" == 200 ]]; do
    ((SECONDS < deadline)) || die "$ready_url/readyz did not answer 200 within $limit s"
    sleep 0.2
  done
}

# start_second ARGS...: a second daemon (`seathold serve ARGS...`) on the
# cluster of start_daemon; sets second_url. Its CPU counts as the daemon's.
second_pid=""
second_url=""
start_second() {
  local log
  log="$work/second-$(date +%s%N).log"
  SEATHOLD_LOG=info NO_COLOR=1 "$bin" serve --listen 127.0.0.1:0 --redis-nodes "$redis_nodes" \
    --shutdown-drain-ms 0 "$@" </dev/null >"$log" 2>&1 &
  second_pid=$!
  await_daemon "$second_pid" "$log" 's/.*serving HTTP addr=\([0-9.:]*\).*/http:\/\/\1/p' \
    "seathold serve $*" 60
  second_url=$ready_url
  echo "second daemon: seathold serve $* at $second_url (pid $second_pid)" >&2
}

# ---------------------------------------------------------------- probes

# CPU ticks (user+system) of the given pids, summed.
proc_ticks() {
  local sum=0 pid f
  for pid in "$@"; do
    if f=$(cat "/proc/$pid/stat" 2>/dev/null); then
      f=${f##*) }
      # After "pid (comm) ": 1 state ... 12 utime 13 stime.
      read -r -a a <<<"$f"
      sum=$((sum + a[11] + a[12]))
    fi
  done
  echo "$sum"
}
# Busy ticks of the whole machine (all CPUs).
machine_ticks() {
  awk '/^cpu /{print $2+$3+$4+$7+$8+$9; exit}' /proc/stat
}
cpu_snapshot() {
  echo "$(machine_ticks) $(proc_ticks "$daemon_pid" $second_pid) $(proc_ticks "${master_pids[@]}") $(proc_ticks "${replica_pids[@]}")"
}
# wait_for_idle: with --wait-idle, waits (at most that long) until the
# machine, not counting our cluster and daemon, used under 25% of one core
# over the last second.
wait_for_idle() {
  ((wait_idle > 0)) || return 0
  local deadline=$((SECONDS + wait_idle)) a b busy
  while ((SECONDS < deadline)); do
    a=$(cpu_snapshot)
    sleep 1
    b=$(cpu_snapshot)
    busy=$(awk -v a="$a" -v b="$b" -v hz="$clk_tck" 'BEGIN {
      split(a, x, " "); split(b, y, " ")
      print int(((y[1] - x[1]) - (y[2] - x[2]) - (y[3] - x[3]) - (y[4] - x[4])) * 100 / hz) }')
    ((busy >= 25)) || return 0
  done
  echo "    (machine still busy: $busy% of a core used by other processes; measuring anyway)" >&2
}

# Redis errors, overload refusals, and conflicts and reads answered by the
# seat view, that the daemon counted so far, from /metrics (missing metrics
# count as 0).
daemon_counters() {
  curl -s --max-time 5 "$url/metrics" 2>/dev/null | awk '
    /^seathold_redis_errors_total/ { e += $NF }
    /^seathold_http_overloaded_total/ { o += $NF }
    /^seathold_view_answers_total\{kind="conflict"\}/ { vc += $NF }
    /^seathold_view_answers_total\{kind="read"\}/ { vr += $NF }
    END { printf "%d %d %d %d\n", e, o, vc, vr }' || echo "0 0 0 0"
}

# The evalsha calls of every master so far (each seathold script is one),
# from INFO commandstats.
master_evalsha() {
  local port sum=0 n
  for port in "${master_ports[@]}"; do
    n=$(redis-cli -h 127.0.0.1 -p "$port" info commandstats | tr -d '\r' |
      sed -n 's/^cmdstat_evalsha:calls=\([0-9]*\),.*/\1/p')
    sum=$((sum + ${n:-0}))
  done
  echo "$sum"
}

# Seats of the hot show of the storm and hotread steps: h1..h$hot_held.
hot_held=100
# hold_hot_seats RUN: holds seats h1..h$hot_held of the show "<RUN>-hot",
# one single-seat hold each with a 20-minute TTL (one curl process, one
# connection), then waits a second: the show is busy enough for a seat view
# (--view-min-rate) and the view is current (--view-max-lag-ms). Dies
# unless every hold was granted.
hold_hot_seats() {
  local run=$1 i granted args=()
  for ((i = 1; i <= hot_held; i++)); do
    args+=(-o /dev/null "$url/v1/shows/$run-hot/seats/h$i/hold")
  done
  granted=$(curl -s --max-time 60 -X POST -H 'Content-Type: application/json' \
    -d '{"ttlMs":1200000}' -w '%{http_code}\n' "${args[@]}" | grep -c '^201$' || true)
  ((granted == hot_held)) || die "only $granted of $hot_held holds of $run-hot were granted"
  sleep 1
}

# empty_cluster: FLUSHALL on every master, then wait until every master and
# replica is empty, flushing again while keys remain: the daemon may still
# write after the load generator stopped (it abandons the holds of the
# requests cut off at the end of a warm-up, and a tombstone lives as long as
# the hold would have). Each step starts from an empty keyspace, as the raw
# step does on a fresh cluster: holds write three keys where a SET writes
# one, and keys left by earlier steps (they live 300 s) would make later
# steps pay for growing and rehashing a big keyspace the raw step never had.
# Measured side by side: about 10% on single-seat holds, and most of the
# noise.
empty_cluster() {
  local port deadline=$((SECONDS + 60)) left
  while :; do
    for port in "${master_ports[@]}"; do
      redis-cli -h 127.0.0.1 -p "$port" flushall >/dev/null || die "FLUSHALL on $port failed"
    done
    sleep 0.2
    left=""
    for port in "${master_ports[@]}" "${replica_ports[@]}"; do
      [[ "$(redis-cli -h 127.0.0.1 -p "$port" dbsize)" == 0 ]] || left=$port
    done
    [[ -n "$left" ]] || return 0
    ((SECONDS < deadline)) || die "node $left still has keys 60 s after FLUSHALL, e.g. $(
      redis-cli -h 127.0.0.1 -p "$left" --scan --count 10 | head -n 3 | tr '\n' ' ')"
  done
}

master_keys() {
  local port sizes=()
  for port in "${master_ports[@]}"; do
    sizes+=("$(redis-cli -h 127.0.0.1 -p "$port" dbsize)")
  done
  echo "${sizes[*]}"
}

# Children's CPU seconds (user + system) so far, from the `times` builtin;
# must run in this shell, not in a subshell. Writes it to the file $1.
children_cpu() {
  times >"$1.times"
  tail -n 1 "$1.times" | awk '{
    t = 0
    for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] }
    print t }' >"$1"
}

# run_client OUT ERR CMD...: runs the load generator in the background (so
# that a signal to this script stops it at once), waits for it and sets
# client_cpu to its CPU seconds and client_rc to its exit code.
run_client() {
  local outf=$1 errf=$2
  shift 2
  children_cpu "$work/cpu0"
  "$@" >"$outf" 2>"$errf" &
  client_pid=$!
  client_rc=0
  wait "$client_pid" || client_rc=$?
  client_pid=""
  children_cpu "$work/cpu1"
  client_cpu=$(awk 'NR == FNR { a = $1; next } { printf "%.3f", $1 - a }' "$work/cpu0" "$work/cpu1")
}

# measure_client CMD...: one measured run of a load generator on an emptied
# cluster (after the command in pre_measure, when set): output in
# $work/step.out and step.err, exit code in client_rc, and in probes the
# arguments finish_step needs (CPU, keys, daemon counters and the masters'
# evalsha calls before and after, wall and client CPU seconds).
probes=()
pre_measure=()
measure_client() {
  local c0 c1 k0 k1 d0 d1 t0 t1 wall x0 x1
  empty_cluster
  if ((${#pre_measure[@]})); then "${pre_measure[@]}"; fi
  wait_for_idle
  x0=$(master_evalsha)
  k0=$(master_keys)
  d0=$(daemon_counters)
  c0=$(cpu_snapshot)
  t0=$(date +%s%N)
  run_client "$work/step.out" "$work/step.err" "$@"
  t1=$(date +%s%N)
  c1=$(cpu_snapshot)
  k1=$(master_keys)
  d1=$(daemon_counters)
  x1=$(master_evalsha)
  wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN{print (b - a) / 1e9}')
  probes=("$c0" "$c1" "$k0" "$k1" "$wall" "$client_cpu" "$d0" "$d1" "$x0" "$x1")
}

# Results of the last step, set by run_wrk / run_raw.
declare -A R

# finish_step START_CPU END_CPU START_KEYS END_KEYS WALL_SECONDS CLIENT_CPU_SECONDS
#             START_DAEMON_COUNTERS END_DAEMON_COUNTERS START_EVALSHA END_EVALSHA
finish_step() {
  local e0 o0 vc0 vr0 e1 o1 vc1 vr1
  read -r e0 o0 vc0 vr0 <<<"$7"
  read -r e1 o1 vc1 vr1 <<<"$8"
  R[redis_errors]=$((e1 - e0))
  R[overloaded]=$((o1 - o0))
  R[view_conflicts]=$((vc1 - vc0))
  R[view_reads]=$((vr1 - vr0))
  R[evalsha]=$((${10} - $9))
  read -r m0 s0 rm0 rr0 <<<"$1"
  read -r m1 s1 rm1 rr1 <<<"$2"
  local k0 k1 wall=$5 client=$6 i deltas=()
  read -r -a k0 <<<"$3"
  read -r -a k1 <<<"$4"
  for i in "${!k1[@]}"; do deltas+=($((k1[i] - k0[i]))); done
  R[keys]=$(IFS=/; echo "${deltas[*]}")
  R[keys_sum]=0
  for i in "${deltas[@]}"; do R[keys_sum]=$((R[keys_sum] + i)); done
  R[keys_min]=$(printf '%s\n' "${deltas[@]}" | sort -n | head -n 1)
  R[mcpu_ticks]=$((rm1 - rm0))
  # Percent of one core over the measured wall time.
  read -r 'R[cpu_client]' 'R[cpu_daemon]' 'R[cpu_rmaster]' 'R[cpu_rreplica]' 'R[cpu_other]' 'R[cpu_total]' < <(
    awk -v hz="$clk_tck" -v wall="$wall" -v cl="$client" \
      -v m="$((m1 - m0))" -v s="$((s1 - s0))" -v rm="$((rm1 - rm0))" -v rr="$((rr1 - rr0))" 'BEGIN {
        c = cl * 100 / wall; t = m / hz * 100 / wall
        d = s / hz * 100 / wall; a = rm / hz * 100 / wall; b = rr / hz * 100 / wall
        o = t - c - d - a - b; if (o < 0) o = 0
        printf "%.0f %.0f %.0f %.0f %.0f %.0f\n", c, d, a, b, o, t }')
}

# per_op: the masters' CPU per answered operation of the last step (R[ok]),
# in microseconds.
per_op() {
  R[mcpu_us]=$(awk -v t="${R[mcpu_ticks]}" -v hz="$clk_tck" -v n="${R[ok]}" \
    'BEGIN { if (n > 0) printf "%.1f", t / hz * 1e6 / n; else print "-" }')
}

# with_retries FUNC ARGS...: runs FUNC, which fills R; while other processes
# took more than 20% of one core and --retries allow, runs it again and keeps
# the quietest attempt. An INVALID attempt is kept and ends the retries (a
# quieter attempt must not hide wrong answers).
attempt=0
with_retries() {
  local k
  local -A best=()
  attempt=0
  while :; do
    "$@"
    if [[ "${R[valid]}" != ok ]]; then
      best=()
      break
    fi
    if ((${#best[@]} == 0 || R[cpu_other] < best[cpu_other])); then
      best=()
      for k in "${!R[@]}"; do best[$k]=${R[$k]}; done
    fi
    ((R[cpu_other] > 20 && attempt < retries)) || break
    attempt=$((attempt + 1))
    echo "    noisy (other processes used ${R[cpu_other]}% of a core); measuring again ($attempt of $retries)" >&2
  done
  if ((${#best[@]})); then
    R=()
    for k in "${!best[@]}"; do R[$k]=${best[$k]}; done
  fi
  R[attempts]=$((attempt + 1))
}

# noisy_mark: appended to the check column when other processes took more
# than 20% of one core during the step.
noisy_mark() {
  if ((R[redis_errors] > 0 || R[overloaded] > 0)); then
    echo -n "; daemon counted ${R[redis_errors]} Redis errors, ${R[overloaded]} overload refusals"
  fi
  if ((R[cpu_other] > 20)); then echo -n "; NOISY: other processes used ${R[cpu_other]}% of a core"; fi
  if ((${R[attempts]:-1} > 1)); then echo -n "; quietest of ${R[attempts]} attempts"; fi
  echo
}

# run_wrk SECTION STEP LUA EXPECT SEATS SHOWS: warm up, then measure with wrk.
run_wrk() {
  local section=$1 step=$2 lua=$3 expect=$4 seats=$5 shows=$6
  local env=(BENCH_EXPECT="$expect" BENCH_SEATS="$seats" BENCH_SHOWS="$shows" BENCH_HELD="$hot_held" BENCH_POOL="$bench_pool")
  local wrk_args=(-t "$threads" -c "$connections" --timeout 5s -s "$lua_dir/$lua" "$url")
  echo "  $section/$step: warm-up ${warmup}s, then ${duration}s" >&2
  if ((warmup > 0)); then
    measure_n=$((measure_n + 1))
    if needs_hot_seats "$step"; then hold_hot_seats "${run_id}w${step}n$measure_n"; fi
    if [[ "$step" == pool1 ]]; then create_pool "${run_id}w${step}n$measure_n"; fi
    env "${env[@]}" BENCH_RUN="${run_id}w${step}n$measure_n" timeout $((warmup + 30)) \
      wrk -d "${warmup}s" "${wrk_args[@]}" >"$work/warm.out" 2>&1 ||
      { cat "$work/warm.out" >&2; die "wrk warm-up of $step failed"; }
  fi
  with_retries measure_wrk "$step" "$expect" "$seats" "${env[@]}" -- "${wrk_args[@]}"
}

# Whether STEP needs the hot show's seats held first (hold_hot_seats).
needs_hot_seats() { [[ "$1" == storm || "$1" == hotread ]]; }

# create_pool RUN: PUT /v1/shows/<RUN>-hot/pools/$bench_pool with a capacity
# no step can use up (pool1.lua holds its units); dies unless the daemon
# answers 200.
bench_pool=coupons
pool_capacity=100000000
create_pool() {
  local code
  code=$(curl -s -o "$work/pool.out" -w '%{http_code}' --max-time 5 -X PUT \
    -H 'Content-Type: application/json' -d "{\"capacity\":$pool_capacity}" \
    "$url/v1/shows/$1-hot/pools/$bench_pool" || true)
  [[ "$code" == 200 ]] || die "PUT pool $1-hot/$bench_pool answered ${code:-nothing}: $(cat "$work/pool.out" 2>/dev/null)"
}

# Every wrk run gets shows of its own ("<run_id>[wm]<step>n<measure_n>"):
# a seat view keeps what it knew of a show across a FLUSHALL (which writes
# no event), so a show is never used again after one.
measure_n=0

# measure_wrk STEP EXPECT SEATS ENV... -- WRK_ARGS...: one measured wrk run.
measure_wrk() {
  local step=$1 expect=$2 seats=$3
  shift 3
  local env=()
  while [[ "$1" != -- ]]; do env+=("$1"); shift; done
  shift
  local wrk_args=("$@")
  measure_n=$((measure_n + 1))
  local bench_run="${run_id}m${step}n$measure_n"
  pre_measure=()
  if needs_hot_seats "$step"; then pre_measure=(hold_hot_seats "$bench_run"); fi
  if [[ "$step" == pool1 ]]; then pre_measure=(create_pool "$bench_run"); fi
  measure_client env "${env[@]}" BENCH_RUN="$bench_run" \
    timeout $((duration + 30)) wrk -d "${duration}s" "${wrk_args[@]}"
  pre_measure=()
  parse_bench wrk "$step" "$expect" "$seats"
}

# parse_bench TOOL STEP EXPECT SEATS: fills R from the BENCH line in
# $work/step.out (cluster/bench/common.lua's keys, which paced prints too).
parse_bench() {
  local tool=$1 step=$2 expect=$3 seats=$4
  if ((client_rc != 0)) || ! grep -q '^BENCH' "$work/step.out"; then
    cat "$work/step.out" "$work/step.err" >&2
    die "$tool failed in step $step (exit $client_rc)"
  fi
  R=()
  local kv
  while IFS= read -r kv; do
    R[${kv%%=*}]=${kv#*=}
  done < <(grep '^BENCH' "$work/step.out" | head -n 1 | tr '\t' '\n' | tail -n +2)
  finish_step "${probes[@]}"
  local secs
  secs=$(awk -v d="${R[duration_us]}" 'BEGIN{print d / 1e6}')
  R[rps]=$(awk -v n="${R[requests]}" -v s="$secs" 'BEGIN{printf "%.0f", n / s}')
  R[ok_rps]=$(awk -v n="${R[ok]}" -v s="$secs" 'BEGIN{printf "%.0f", n / s}')
  R[seats_rps]=$(awk -v n="${R[ok]}" -v k="$seats" -v s="$secs" 'BEGIN{printf "%.0f", n * k / s}')
  R[p50]=$(awk -v v="${R[p50_us]}" 'BEGIN{printf "%.2f", v / 1000}')
  R[p99]=$(awk -v v="${R[p99_us]}" 'BEGIN{printf "%.2f", v / 1000}')
  R[max]=$(awk -v v="${R[max_us]}" 'BEGIN{printf "%.1f", v / 1000}')
  R[seats]=$seats
  R[expect]=$expect
  per_op
  R[valid]=ok
  if ((R[not_ok] > 0 || R[socket_errors] > 0 || R[counted] != R[requests] || R[ok] == 0)); then
    R[valid]="INVALID: ${R[not_ok]} non-$expect, ${R[socket_errors]} socket errors"
    [[ -z "${R[sample]:-}" ]] || echo "    first unexpected body: ${R[sample]}" >&2
  fi
}

# run_paced SECTION STEP SEATS SHOWS RATE: holds offered at RATE per second
# (open loop, cluster/bench/paced.rs) for the warm-up and then the measured
# time; only the measured time counts.
run_paced() {
  local section=$1 step=$2 seats=$3 shows=$4 rate=$5
  echo "  $section/$step: $rate/s offered, ${warmup}s warm-up, then ${duration}s" >&2
  with_retries measure_paced "$step" "$seats" "$shows" "$rate"
}

# measure_paced STEP SEATS SHOWS RATE: one measured paced run.
measure_paced() {
  local step=$1 seats=$2 shows=$3 rate=$4
  measure_n=$((measure_n + 1))
  measure_client timeout $((warmup + duration + 30)) "$paced" --addr "${url#http://}" \
    --rate "$rate" --duration "$duration" --warmup "$warmup" --connections "$connections" \
    --seats "$seats" --shows "$shows" --arrivals "$arrivals" --seed "$measure_n" \
    --run "${run_id}p${step}n$measure_n"
  parse_bench paced "$step" 201 "$seats"
  R[p999]=$(awk -v v="${R[p999_us]}" 'BEGIN{printf "%.2f", v / 1000}')
  R[send_p99]=$(awk -v v="${R[send_p99_us]}" 'BEGIN{printf "%.2f", v / 1000}')
}

# run_raw SECTION STEP: redis-benchmark --cluster SET ... NX PX, sized by a warm-up.
run_raw() {
  local section=$1 step=$2
  local token=3f0c2b9e-0000-4000-8000-000000000000
  local cmd=(SET 'seat-hold:{tag}:__rand_int__' "$token" NX PX 300000)
  local args=(-h 127.0.0.1 -p "${master_ports[0]}" --threads "$threads"
    -c "$connections" -r 2000000000 --csv)
  # redis-benchmark refuses --cluster with a single master ("Invalid
  # cluster: 1 node(s)"); that master owns every slot, so plain mode (where
  # {tag} stays literal, one slot) sends every key to the right node.
  ((${#master_ports[@]} == 1)) || args+=(--cluster)
  local warm_n=$((warmup > 0 ? 20000 * warmup : 20000))
  echo "  $section/$step: warm-up ${warm_n} requests, then about ${duration}s" >&2
  local line rate n
  line=$(timeout $((warmup + 60)) redis-benchmark "${args[@]}" -n "$warm_n" "${cmd[@]}" 2>&1 | tail -n 1) ||
    die "redis-benchmark warm-up failed: $line"
  rate=$(awk -F'"' '{print int($4)}' <<<"$line")
  ((rate > 0)) || die "redis-benchmark warm-up gave no rate: $line"
  n=$((rate * duration))
  ((n >= 10000)) || n=10000
  with_retries measure_raw "$step" "$n" "${args[@]}" -- "${cmd[@]}"
}

# measure_raw STEP N ARGS... -- CMD...: one measured redis-benchmark run.
measure_raw() {
  local step=$1 n=$2
  shift 2
  local args=()
  while [[ "$1" != -- ]]; do args+=("$1"); shift; done
  shift
  local cmd=("$@")
  local line
  measure_client timeout $((duration * 4 + 30)) redis-benchmark "${args[@]}" -n "$n" "${cmd[@]}"
  line=$(grep '^"SET' "$work/step.out" | tail -n 1 || true)
  if ((client_rc != 0)) || [[ -z "$line" ]]; then
    cat "$work/step.out" "$work/step.err" >&2
    die "redis-benchmark failed in step $step (exit $client_rc)"
  fi
  R=()
  finish_step "${probes[@]}"
  # "test","rps","avg","min","p50","p95","p99","max"
  R[rps]=$(awk -F'"' '{printf "%.0f", $4}' <<<"$line")
  R[ok_rps]=${R[rps]}
  R[seats_rps]=${R[rps]}
  R[p50]=$(awk -F'"' '{printf "%.2f", $10}' <<<"$line")
  R[p99]=$(awk -F'"' '{printf "%.2f", $14}' <<<"$line")
  R[max]=$(awk -F'"' '{printf "%.1f", $16}' <<<"$line")
  R[requests]=$n
  R[seats]=1
  R[expect]=OK
  # redis-benchmark does not count replies; what reached Redis is checked
  # by the keys that appeared on every master (random keys over a space of
  # 2*10^9 per master, so NX collisions stay far below 1%).
  R[ok]=${R[keys_sum]}
  R[not_ok]=$((n - R[keys_sum]))
  R[statuses]="keys:${R[keys]}"
  R[socket_errors]=0
  per_op
  R[valid]=ok
  if ((R[keys_min] == 0)); then
    R[valid]="INVALID: some master got no keys (${R[keys]})"
  elif ((R[keys_sum] * 100 < n * 99)); then
    R[valid]="INVALID: only ${R[keys_sum]} of $n SETs wrote a key"
  fi
}

# ---------------------------------------------------------------- output

printf 'section\tstep\tmasters\tseats_per_hold\trequests\tok\tnot_ok\tstatuses\treq_per_s\tok_per_s\tseats_per_s\tp50_ms\tp99_ms\tmax_ms\tratio_to_raw\tcpu_client_pct\tcpu_seathold_pct\tcpu_redis_masters_pct\tcpu_redis_replicas_pct\tcpu_other_pct\tkeys_per_master\tdaemon_redis_errors\tdaemon_overloaded\tattempts\tvalid\tmaster_cpu_us_per_ok\tmaster_evalsha\tview_conflicts\tview_reads\n' >"$out"

cpu_rows=()

ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (b > 0) printf "%.2f", a / b; else print "-" }'; }

record() {
  local section=$1 step=$2 masters=$3 raw=$4
  local r
  r=$(ratio "${R[ok_rps]}" "$raw")
  R[ratio]=$r
  R[note]=$(noisy_mark)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
    "$section" "$step" "$masters" "${R[seats]}" "${R[requests]}" "${R[ok]}" "${R[not_ok]}" "${R[statuses]}" \
    "${R[rps]}" "${R[ok_rps]}" "${R[seats_rps]}" "${R[p50]}" "${R[p99]}" "${R[max]}" "$r" \
    "${R[cpu_client]}" "${R[cpu_daemon]}" "${R[cpu_rmaster]}" "${R[cpu_rreplica]}" "${R[cpu_other]}" \
    "${R[keys]}" "${R[redis_errors]}" "${R[overloaded]}" "${R[attempts]}" "${R[valid]}" \
    "${R[mcpu_us]}" "${R[evalsha]}" "${R[view_conflicts]}" "${R[view_reads]}" >>"$out"
  cpu_rows+=("$(printf '%-8s %-12s %7s %9s %10s %11s %7s %7s   %s' "$section" "$step" \
    "${R[cpu_client]}" "${R[cpu_daemon]}" "${R[cpu_rmaster]}" "${R[cpu_rreplica]}" "${R[cpu_other]}" \
    "${R[cpu_total]}" "${R[keys]}")")
}

# A speed, or the INVALID mark instead of it.
speed() { if [[ "${R[valid]}" == ok ]]; then echo "$1"; else echo "INVALID"; fi; }

# collect STEP RAW: keeps this round's figures of STEP (in R) for the
# median row of the side-by-side table.
collect() {
  local step=$1 raw=$2
  M[$step,rps]+=" ${R[ok_rps]}"
  M[$step,seats]+=" ${R[seats_rps]}"
  M[$step,ratio]+=" $(ratio "${R[ok_rps]}" "$raw")"
  M[$step,sratio]+=" $(ratio "${R[seats_rps]}" "$raw")"
  M[$step,p50]+=" ${R[p50]}"
  M[$step,p99]+=" ${R[p99]}"
  M[$step,max]+=" ${R[max]}"
  M[$step,mcpu]+=" ${R[mcpu_us]}"
  M[$step,expect]=${R[expect]}
  if [[ "$step" == storm && "${R[requests]}" -gt 0 ]]; then
    # Refusals that reached no master: by the view's own count, and by the
    # masters' evalsha calls (each refusal Redis gave is one).
    M[$step,byview]+=" $(awk -v v="${R[view_conflicts]}" -v n="${R[requests]}" 'BEGIN{printf "%.1f", v * 100 / n}')"
    M[$step,noredis]+=" $(awk -v x="${R[evalsha]}" -v n="${R[requests]}" 'BEGIN{f = 100 - x * 100 / n; if (f < 0) f = 0; printf "%.1f", f}')"
  fi
  if [[ "$step" == hotread && "${R[requests]}" -gt 0 ]]; then
    M[$step,byview]+=" $(awk -v v="${R[view_reads]}" -v n="${R[requests]}" 'BEGIN{printf "%.1f", v * 100 / n}')"
  fi
  M[$step,ok]=$((${M[$step,ok]:-0} + ${R[ok]:-0}))
  M[$step,not_ok]=$((${M[$step,not_ok]:-0} + ${R[not_ok]:-0}))
  [[ "${R[valid]}" == ok ]] || M[$step,invalid]="${R[valid]} (${R[statuses]})"
  [[ -z "${R[note]}" ]] || M[$step,note]+="${R[note]}"
}
# median WORDS...: the median of numbers (the mean of the middle two when
# there is an even count).
median() {
  printf '%s\n' "$@" | sort -g | awk '{ a[NR] = $1 } END {
    if (NR == 0) print "-"; else if (NR % 2) print a[(NR + 1) / 2];
    else printf "%.2f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
# spread WORDS...: "min-max" of numbers.
spread() { printf '%s\n' "$@" | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { print lo "-" hi }'; }
# main_line STEP WHAT: the median row of STEP over the rounds.
main_line() {
  local step=$1 what=$2 check
  local -a rps seats ratios sratios p50 p99 maxes
  read -r -a rps <<<"${M[$step,rps]}"
  read -r -a seats <<<"${M[$step,seats]}"
  read -r -a ratios <<<"${M[$step,ratio]}"
  read -r -a sratios <<<"${M[$step,sratio]}"
  read -r -a p50 <<<"${M[$step,p50]}"
  read -r -a p99 <<<"${M[$step,p99]}"
  read -r -a maxes <<<"${M[$step,max]}"
  if [[ -n "${M[$step,invalid]:-}" ]]; then
    printf '%-7s %-46s %9s %9s %8s %8s %6s %10s %6s  %s' "$step" "$what" INVALID INVALID - - - - - \
      "INVALID in a round: ${M[$step,invalid]}"
    return
  fi
  if [[ "$step" == raw ]]; then
    check="ok (${M[$step,ok]} SETs in $rounds round(s))"
    ratios=(1.00) sratios=(1.00)
  else
    check="ok (${M[$step,ok]} answers, all ${M[$step,expect]}; max $(median "${maxes[@]}") ms, median round)"
  fi
  if [[ -n "${M[$step,byview]:-}" ]]; then
    local -a byview noredis
    read -r -a byview <<<"${M[$step,byview]}"
    check+="; $(median "${byview[@]}")% answered by the seat view"
    if [[ -n "${M[$step,noredis]:-}" ]]; then
      read -r -a noredis <<<"${M[$step,noredis]}"
      check+=", $(median "${noredis[@]}")% reached no master (evalsha)"
    fi
  fi
  printf '%-7s %-46s %9s %9s %8s %8s %6s %10s %6s  %s' "$step" "$what" \
    "$(median "${rps[@]}")" "$(median "${seats[@]}")" "$(median "${p50[@]}")" "$(median "${p99[@]}")" \
    "$(median "${ratios[@]}")" "$(spread "${ratios[@]}")" "$(median "${sratios[@]}")" "$check${M[$step,note]:-}"
}

main_lines=()
latency_lines=()
cpu_op_lines=()
growth_lines=()
masters_lines=()
events_lines=()

# ---------------------------------------------------------------- run

start=$SECONDS
echo "seathold benchmark: ${duration}s per step (+${warmup}s warm-up), $connections connections, $threads client threads, $ncpu CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2

if has_section main || has_section growth; then
  start_daemon 3
  raw3=""
  if has_section main; then
    # Rounds: raw SET, then every seathold step, each step's ratio taken to
    # the raw SET/s of its own round, so that a machine that slows down or
    # speeds up during the run moves both sides of a ratio alike.
    main_steps=(raw
      "hold1 hold1.lua 201 1 1000000 POST .../seats/{seat}/hold, random show"
      "hold4 holds.lua 201 4 1000000 POST .../holds, 4 seats, random show"
      "hot1 hold1.lua 201 1 0 POST .../seats/{seat}/hold, one hot show"
      "hot4 holds.lua 201 4 0 POST .../holds, 4 seats, one hot show"
      "read read.lua 200 1 1000000 GET .../seats/{seat}, random show"
      "storm storm.lua 409 1 0 POST .../seats/{seat}/hold, held seats, hot show"
      "hotread hotread.lua 200 1 0 GET .../seats/{seat}, held seats, hot show"
      "pool1 pool1.lua 201 1 0 POST .../holds, 1 unit of one hot pool")
    declare -A M=()
    for ((round = 1; round <= rounds; round++)); do
      echo "  main: round $round of $rounds" >&2
      run_raw main raw
      raw3=${R[ok_rps]}
      record main "raw.r$round" 3 "$raw3"
      collect raw "$raw3"
      for spec in "${main_steps[@]:1}"; do
        read -r step lua expect seats shows _ <<<"$spec"
        run_wrk main "$step" "$lua" "$expect" "$seats" "$shows"
        record main "$step.r$round" 3 "$raw3"
        collect "$step" "$raw3"
      done
    done
    for spec in "${main_steps[@]}"; do
      read -r step _ _ _ _ what <<<"$spec"
      [[ "$step" == raw ]] && what="SET {tag}:<rand> NX PX (redis-benchmark)"
      main_lines+=("$(main_line "$step" "$what")")
    done
    # The masters' CPU per operation, median of the rounds, next to raw's.
    read -r -a raw_mcpu <<<"${M[raw,mcpu]}"
    raw_us=$(median "${raw_mcpu[@]}")
    for spec in "${main_steps[@]}"; do
      read -r step _ _ _ _ <<<"$spec"
      case "$step" in
        raw) per="SET NX PX" ;;
        hold1 | hot1) per="granted hold, 1 seat" ;;
        hold4 | hot4) per="granted hold, 4 seats" ;;
        read | hotread) per="read" ;;
        storm) per="refusal (409)" ;;
        *) per="answer" ;;
      esac
      read -r -a step_mcpu <<<"${M[$step,mcpu]}"
      step_us=$(median "${step_mcpu[@]}")
      x=-
      if [[ -n "${M[$step,invalid]:-}" ]]; then
        step_us=INVALID
      elif [[ "$step_us" =~ ^[0-9.]+$ && "$raw_us" =~ ^[0-9.]+$ ]]; then
        x=$(ratio "$step_us" "$raw_us")
      fi
      cpu_op_lines+=("$(printf '%-8s %-24s %12s %9s' "$step" "$per" "$step_us" "$x")")
    done
  fi
  if has_section growth; then
    if [[ -z "$raw3" ]]; then
      run_raw growth raw
      raw3=${R[ok_rps]}
      record growth raw 3 "$raw3"
    fi
    base=""
    for n in 1 2 4 8 16 20; do
      run_wrk growth "n$n" holds.lua 201 "$n" 1000000
      record growth "n$n" 3 "$raw3"
      if [[ -z "$base" && "${R[valid]}" == ok ]]; then base=${R[seats_rps]}; fi
      cost=$(if [[ -n "$base" ]]; then ratio "$base" "${R[seats_rps]}"; else echo -; fi)
      growth_lines+=("$(printf '%4s %9s %9s %8s %8s %13s %10s  %s' "$n" "$(speed "${R[ok_rps]}")" \
        "$(speed "${R[seats_rps]}")" "${R[p50]}" "${R[p99]}" "$(speed "$cost")" \
        "$(speed "$(ratio "${R[seats_rps]}" "$raw3")")" "${R[valid]} (${R[statuses]}; max ${R[max]} ms)${R[note]}")")
    done
  fi
  stop_daemon
fi

if has_section masters; then
  for m in 1 3; do
    start_daemon "$m"
    run_raw masters "raw-m$m"
    raw=${R[ok_rps]}
    record masters "raw-m$m" "$m" "$raw"
    rawline=("$(speed "$raw")" "${R[p50]}" "${R[p99]}" "${R[valid]}${R[note]}")
    run_wrk masters "hold1-m$m" hold1.lua 201 1 1000000
    record masters "hold1-m$m" "$m" "$raw"
    masters_lines+=("$(printf '%7s %10s %7s %7s %10s %7s %7s %7s  %s' "$m" "${rawline[0]}" "${rawline[1]}" \
      "${rawline[2]}" "$(speed "${R[ok_rps]}")" "${R[p50]}" "${R[p99]}" "$(speed "${R[ratio]}")" \
      "raw ${rawline[3]}; holds ${R[valid]} (${R[statuses]}; max ${R[max]} ms)${R[note]}")")
    stop_daemon
  done
fi

if has_section events; then
  # Event streams off and on, side by side: one fresh 3-master cluster, the
  # dev daemon with events on and a second one (`serve --events off`) on
  # the same cluster. Each round measures raw SET, then every step on both
  # daemons in turn (which goes first alternates by round), so both see
  # the same machine state; on/off is the ratio of their holds/s within
  # the round, and the table shows medians over the rounds.
  declare -A E=()
  start_daemon 3
  on_url=$url
  start_second --events off
  off_url=$second_url
  for ((round = 1; round <= rounds; round++)); do
    echo "  events: round $round of $rounds" >&2
    run_raw events "raw-ev"
    raw=${R[ok_rps]}
    record events "raw-ev.r$round" 3 "$raw"
    order="off on"
    ((round % 2)) || order="on off"
    for spec in "hold1 hold1.lua 1 1000000" "hot1 hold1.lua 1 0" "hold4 holds.lua 4 1000000"; do
      read -r step lua seats shows <<<"$spec"
      declare -A got=()
      for events in $order; do
        if [[ "$events" == on ]]; then url=$on_url; else url=$off_url; fi
        run_wrk events "$step-ev$events" "$lua" 201 "$seats" "$shows"
        record events "$step-ev$events.r$round" 3 "$raw"
        got[$events]=${R[ok_rps]}
        E[$step,$events]+=" $(ratio "${R[ok_rps]}" "$raw")"
        E[$step,$events,rps]+=" ${R[ok_rps]}"
        E[$step,$events,p99]+=" ${R[p99]}"
        [[ "${R[valid]}" == ok ]] || E[$step,$events,invalid]="${R[valid]} (${R[statuses]})"
      done
      E[$step,onoff]+=" $(ratio "${got[on]}" "${got[off]}")"
      unset got
    done
  done
  url=$on_url
  stop_daemon
  for step in hold1 hot1 hold4; do
    read -r -a off <<<"${E[$step,off]}"
    read -r -a on <<<"${E[$step,on]}"
    read -r -a onoff <<<"${E[$step,onoff]}"
    read -r -a offrps <<<"${E[$step,off,rps]}"
    read -r -a onrps <<<"${E[$step,on,rps]}"
    read -r -a offp99 <<<"${E[$step,off,p99]}"
    read -r -a onp99 <<<"${E[$step,on,p99]}"
    check="${E[$step,off,invalid]:-}${E[$step,on,invalid]:-}"
    events_lines+=("$(printf '%-6s %9s %6s %8s %9s %6s %8s %9s %11s  %s' "$step" \
      "$(median "${offrps[@]}")" "$(median "${off[@]}")" "$(median "${offp99[@]}")" \
      "$(median "${onrps[@]}")" "$(median "${on[@]}")" "$(median "${onp99[@]}")" \
      "$(median "${onoff[@]}")" "$(spread "${onoff[@]}")" "${check:-ok}")")
  done
fi

if has_section latency; then
  # Each round: a step's closed-loop holds/s (wrk, as in main), then the
  # same holds offered at fixed fractions of it (paced), on one cluster.
  declare -A L=()
  start_daemon 3
  latency_steps=("hold1 hold1.lua 1 1000000" "hot1 hold1.lua 1 0" "hold4 holds.lua 4 1000000" "hot4 holds.lua 4 0")
  for ((round = 1; round <= rounds; round++)); do
    echo "  latency: round $round of $rounds" >&2
    for spec in "${latency_steps[@]}"; do
      read -r step lua seats shows <<<"$spec"
      run_wrk latency "$step-wrk" "$lua" 201 "$seats" "$shows"
      record latency "$step-wrk.r$round" 3 "${R[ok_rps]}"
      capacity=${R[ok_rps]}
      L[$step,wrk,rps]+=" ${R[ok_rps]}"
      L[$step,wrk,p50]+=" ${R[p50]}"
      L[$step,wrk,p99]+=" ${R[p99]}"
      L[$step,wrk,max]+=" ${R[max]}"
      [[ "${R[valid]}" == ok ]] || L[$step,wrk,invalid]="${R[valid]} (${R[statuses]})"
      for pct in 25 50 75; do
        rate=$((capacity * pct / 100))
        ((rate > 0)) || rate=1
        run_paced latency "$step-$pct" "$seats" "$shows" "$rate"
        record latency "$step-$pct.r$round" 3 "$capacity"
        L[$step,$pct,offered]+=" $rate"
        L[$step,$pct,rps]+=" ${R[ok_rps]}"
        L[$step,$pct,p50]+=" ${R[p50]}"
        L[$step,$pct,p99]+=" ${R[p99]}"
        L[$step,$pct,p999]+=" ${R[p999]}"
        L[$step,$pct,max]+=" ${R[max]}"
        L[$step,$pct,send_p99]+=" ${R[send_p99]}"
        L[$step,$pct,late]+=" $(awk -v l="${R[late_1ms]}" -v n="${R[requests]}" 'BEGIN{ if (n > 0) printf "%.1f", l * 100 / n; else print 0 }')"
        [[ "${R[valid]}" == ok ]] || L[$step,$pct,invalid]="${R[valid]} (${R[statuses]})"
        [[ -z "${R[note]}" ]] || L[$step,$pct,note]+="${R[note]}"
      done
    done
  done
  stop_daemon
  for spec in "${latency_steps[@]}"; do
    read -r step _ <<<"$spec"
    for load in wrk 25 50 75; do
      check="${L[$step,$load,invalid]:-}"
      if [[ -n "$check" ]]; then
        latency_lines+=("$(printf '%-6s %5s  INVALID in a round: %s' "$step" "$load" "$check")")
        continue
      fi
      read -r -a rps <<<"${L[$step,$load,rps]}"
      read -r -a p50 <<<"${L[$step,$load,p50]}"
      read -r -a p99 <<<"${L[$step,$load,p99]}"
      read -r -a maxes <<<"${L[$step,$load,max]}"
      if [[ "$load" == wrk ]]; then
        latency_lines+=("$(printf '%-6s %5s %9s %10s %7s %7s %7s %7s %9s %8s  %s' "$step" "wrk" "-" \
          "$(median "${rps[@]}")" "$(median "${p50[@]}")" "$(median "${p99[@]}")" "-" \
          "$(median "${maxes[@]}")" "-" "-" "closed loop: every connection always busy")")
      else
        read -r -a offered <<<"${L[$step,$load,offered]}"
        read -r -a p999 <<<"${L[$step,$load,p999]}"
        read -r -a sp99 <<<"${L[$step,$load,send_p99]}"
        read -r -a late <<<"${L[$step,$load,late]}"
        latency_lines+=("$(printf '%-6s %5s %9s %10s %7s %7s %7s %7s %9s %8s  %s' "$step" "$load%" \
          "$(median "${offered[@]}")" "$(median "${rps[@]}")" "$(median "${p50[@]}")" "$(median "${p99[@]}")" \
          "$(median "${p999[@]}")" "$(median "${maxes[@]}")" "$(median "${sp99[@]}")" "$(median "${late[@]}")%" \
          "ok (p99 range $(spread "${p99[@]}") ms)${L[$step,$load,note]:-}")")
      fi
    done
  done
fi

# ---------------------------------------------------------------- report

echo
echo "seathold benchmark, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -m), $ncpu CPUs (shared by clients, daemon and Redis; nothing pinned)"
echo "${duration}s per step after ${warmup}s warm-up; $connections connections; $threads wrk threads / redis-benchmark threads; $replicas replica(s) per master; $("$bin" --version 2>/dev/null || echo seathold); $(redis-server --version | awk '{print $3}')"
if ((${#main_lines[@]})); then
  echo
  echo "Side by side, 3 masters, median of $rounds round(s) (latency in ms; x raw = per second divided by"
  echo "the raw SET/s of the same round; x range = lowest-highest x raw over the rounds)"
  printf '%-7s %-46s %9s %9s %8s %8s %6s %10s %6s  %s\n' step what "holds/s" "seats/s" p50 p99 "x raw" "x range" "seats" "check"
  printf '%s\n' "${main_lines[@]}"
fi
if ((${#cpu_op_lines[@]})); then
  echo
  echo "Redis masters' CPU per operation (all masters together, microseconds; median of $rounds round(s);"
  echo "x raw SET = the step's CPU per operation divided by raw's: what one answer costs Redis)"
  printf '%-8s %-24s %12s %9s\n' step "per" "us/op" "x raw SET"
  printf '%s\n' "${cpu_op_lines[@]}"
fi
if ((${#latency_lines[@]})); then
  echo
  echo "Latency at a fixed offered rate, 3 masters, median of $rounds round(s) (ms): each step first"
  echo "with wrk (closed loop), then offered 25/50/75% of wrk's holds/s of the same round by paced"
  echo "(open loop, $connections connections, $arrivals arrivals: each request is due at its time whether"
  echo "or not earlier ones were answered; p50-max count from when it was due, \"sent p99\" from its send,"
  echo "as wrk counts; late = sent more than 1 ms after it was due: all connections busy, or paced itself late)"
  printf '%-6s %5s %9s %10s %7s %7s %7s %7s %9s %8s  %s\n' step load "offered/s" "answered/s" p50 p99 p99.9 max "sent p99" late check
  printf '%s\n' "${latency_lines[@]}"
fi
if ((${#growth_lines[@]})); then
  echo
  echo "Growth: N-seat holds over POST /v1/shows/{show}/holds, random shows, 3 masters"
  printf '%4s %9s %9s %8s %8s %13s %10s  %s\n' N "holds/s" "seats/s" p50 p99 "cost/seat/N1" "seats/raw" check
  printf '%s\n' "${growth_lines[@]}"
fi
if ((${#masters_lines[@]})); then
  echo
  echo "Masters: single-seat holds (random shows) on fresh clusters"
  printf '%7s %10s %7s %7s %10s %7s %7s %7s  %s\n' masters "raw SET/s" p50 p99 "holds/s" p50 p99 "x raw" check
  printf '%s\n' "${masters_lines[@]}"
fi
if ((${#events_lines[@]})); then
  echo
  echo "Event streams: holds with --events off and on side by side (two daemons, one 3-master"
  echo "cluster, each step on both in turn), median of $rounds round(s); x raw = holds/s divided by the"
  echo "raw SET/s of the same round; on/off = on holds/s divided by off holds/s of the same round"
  printf '%-6s %9s %6s %8s %9s %6s %8s %9s %11s  %s\n' step "off /s" "x raw" "p99" "on /s" "x raw" "p99" "on/off" "range" check
  printf '%s\n' "${events_lines[@]}"
fi
echo
echo "CPU during each measured step, percent of one core (max $((ncpu * 100))); client = wrk or redis-benchmark"
printf '%-8s %-12s %7s %9s %10s %11s %7s %7s   %s\n' section step client seathold "redis-mstr" "redis-repl" other total "keys added per master"
printf '%s\n' "${cpu_rows[@]}"
echo
cat <<'EOF'
Notes: "x raw" is holds/s (reads/s) divided by the raw SET/s of the same
cluster, "seats" the same for seats/s; "cost/seat/N1" is the cost of one
seat relative to single-seat holds (seats/s at N=1 / seats/s at N).
A step with any answer other than 201 (200 for reads, 409 for the storm) or
any socket error is INVALID and shows no speed. storm and hotread: 100 seats
of one hot show held beforehand; "answered by the seat view" counts the
daemon's seathold_view_answers_total, "reached no master" the masters'
evalsha calls during the step (one per answer that Redis gave). NOISY: processes other than ours took that much
CPU during the step. raw: redis-benchmark --cluster routes only keys whose
hash tag is its {tag} placeholder (it puts there a tag of one slot of each
master); a hash tag holding __rand_int__ gets MOVED, which it does not
follow, so the raw keys are seat-hold:{<tag>}:<random>, checked by the keys
that appeared on every master.
EOF
echo "machine-readable results: $out   (total time $((SECONDS - start)) s)"
if grep -q 'INVALID' "$out"; then
  echo "some steps are INVALID (see the check column)"
fi
