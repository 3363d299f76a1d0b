# shellcheck shell=bash
# dev.sh: sourced by the cluster/bench scripts that run a `seathold dev` of
# their own. Sets `work` (a temporary folder) and a trap that stops the
# daemon (and its cluster) and removes the folder on exit.
#   start_dev BIN PORT   starts `BIN dev` on 127.0.0.1:PORT, waits for its
#                        /readyz, and sets `masters` to the ports of its
#                        three masters (exits when it does not start)
#   wait_ready PORT      waits (up to 30 s) until 127.0.0.1:PORT/readyz is 200
#   master_calls CMD     calls of CMD on the masters, summed (commandstats)
#   master_ticks         CPU ticks (user + system, /proc) of the masters
#   ttl_hold_lua TTL_MS  writes $work/hold.lua: wrk single-seat holds of
#                        TTL_MS on random shows

bench_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
dev_pid=
masters=()

stop_dev() {
  if [[ -n "$dev_pid" ]]; then
    kill -INT "$dev_pid" 2>/dev/null || true
    wait "$dev_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap stop_dev EXIT

start_dev() {
  local bin=$1 port=$2
  SEATHOLD_LOG=warn "$bin" dev --listen "127.0.0.1:$port" >"$work/dev.out" 2>&1 &
  dev_pid=$!
  wait_ready "$port"
  mapfile -t masters < <(grep -o 'redis://127.0.0.1:[0-9]*' "$work/dev.out" | head -n 3 | cut -d: -f3)
  ((${#masters[@]} == 3)) || {
    echo "seathold dev did not start: $(cat "$work/dev.out")" >&2
    exit 1
  }
}

wait_ready() {
  for _ in $(seq 300); do
    curl -fs "http://127.0.0.1:$1/readyz" >/dev/null 2>&1 && return
    sleep 0.1
  done
}

master_calls() {
  local sum=0 p n
  for p in "${masters[@]}"; do
    n=$(redis-cli -p "$p" info commandstats | grep -o "cmdstat_$1:calls=[0-9]*" | cut -d= -f2 || true)
    sum=$((sum + ${n:-0}))
  done
  echo "$sum"
}

master_ticks() {
  local sum=0 p pid fields
  for p in "${masters[@]}"; do
    pid=$(pgrep -f "redis-server 127.0.0.1:$p" | head -n 1)
    read -r -a fields <"/proc/$pid/stat"
    sum=$((sum + fields[13] + fields[14]))
  done
  echo "$sum"
}

ttl_hold_lua() {
  cat >"$work/hold.lua" <<EOF
dofile("$bench_dir/common.lua")
function request()
   return wrk.format("POST", "/v1/shows/" .. random_show() .. "/seats/" .. random_seat() .. "/hold",
      {["content-type"] = "application/json"}, '{"ttlMs":$1}')
end
EOF
}
