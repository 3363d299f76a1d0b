# shellcheck shell=bash
# dev.sh: sourced by the cluster/bench scripts that run a `seathold dev` of
# their own. Sets `work` (a temporary folder) and a trap that stops the
# daemon (and its cluster) and removes the folder on exit.
#   start_dev BIN PORT   starts `BIN dev` on 127.0.0.1:PORT, waits for its
#                        /readyz, and sets `masters` to the ports of its
#                        three masters (exits when it does not start)

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
  for _ in $(seq 300); do
    curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  mapfile -t masters < <(grep -o 'redis://127.0.0.1:[0-9]*' "$work/dev.out" | head -n 3 | cut -d: -f3)
  ((${#masters[@]} == 3)) || {
    echo "seathold dev did not start: $(cat "$work/dev.out")" >&2
    exit 1
  }
}
