#!/usr/bin/env bash
# Stops the Redis Cluster nodes that cluster/start-cluster.sh started in DIR:
# SIGTERM to the redis-server of every DIR/PORT/redis.pid (Redis then fsyncs
# the AOF, writes a final RDB snapshot and exits), then waits for them to
# exit. Data stays in DIR unless -x is given, so start-cluster.sh on the same
# DIR and ports brings the same cluster back.
set -euo pipefail

usage() {
  cat <<EOF
Usage: $(basename "$0") [-x] [-t SECONDS] DIR

Stops every redis-server whose pid file is DIR/*/redis.pid.

Options:
  -x          afterwards delete the node directories (DIR/PORT: data, AOF,
              nodes.conf, logs) and DIR itself if it is then empty; for
              throwaway test clusters only
  -t SECONDS  how long to wait for the nodes to exit (default: 30)
  -h          this help
EOF
}

die() {
  echo "stop-cluster: $*" >&2
  exit 1
}

purge=0
wait_s=30
while getopts ":xt:h" opt; do
  case "$opt" in
    x) purge=1 ;;
    t) wait_s="$OPTARG" ;;
    h)
      usage
      exit 0
      ;;
    :)
      usage >&2
      die "option -$OPTARG needs a value"
      ;;
    *)
      usage >&2
      die "unknown option -$OPTARG"
      ;;
  esac
done
shift $((OPTIND - 1))
if (($# != 1)); then
  usage >&2
  exit 2
fi
dir="$1"
[[ -d "$dir" ]] || die "no directory $dir"
[[ "$wait_s" =~ ^[0-9]+$ ]] || die "-t needs a number of seconds, not '$wait_s'"

# The pid of the redis-server of node directory $1, if it is running. The pid
# file may be stale (a crash, a reboot) and its pid reused by another
# program, so the process must be a redis-server.
node_pid() {
  local pidfile="$1/redis.pid" pid
  [[ -s "$pidfile" ]] || return 1
  pid="$(<"$pidfile")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  # /proc where there is one: slim images have no ps, and without it no
  # node was found, none stopped, and -x deleted their folders under them.
  local comm
  if [[ -r "/proc/$pid/comm" ]]; then
    comm="$(<"/proc/$pid/comm")"
  else
    comm="$(ps -o comm= -p "$pid" 2>/dev/null)"
  fi
  [[ "${comm##*/}" == redis-server* ]] || return 1
  echo "$pid"
}

nodes=()
for node in "$dir"/*/; do
  node="${node%/}"
  [[ -f "$node/node.conf" ]] || continue
  nodes+=("$node")
done
((${#nodes[@]})) || die "no nodes of start-cluster.sh in $dir"

pids=()
for node in "${nodes[@]}"; do
  if pid="$(node_pid "$node")"; then
    echo "stopping $(basename "$node") (pid $pid)"
    kill -TERM "$pid"
    pids+=("$pid")
  fi
done

deadline=$((SECONDS + wait_s))
for pid in "${pids[@]}"; do
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      die "pid $pid did not exit in ${wait_s}s; see its redis.log (kill -KILL $pid loses up to a second of writes)"
    fi
    sleep 0.2
  done
done
echo "stopped ${#pids[@]} node(s) in $dir"

if ((purge)); then
  for node in "${nodes[@]}"; do
    rm -rf -- "$node"
  done
  rmdir -- "$dir" 2>/dev/null || true
  echo "deleted the node directories in $dir"
fi
