#!/usr/bin/env bash
# Brings up a Redis Cluster for seathold from cluster/redis.conf: one
# redis-server per port, each in DIR/PORT, then `redis-cli --cluster create`
# with the given number of replicas per master, and waits until every node
# reports cluster_state:ok and every replica's link to its master is up.
#
# Running it again on the same DIR and ports restarts the existing nodes
# (their nodes.conf remembers the cluster) instead of creating a new one.
# Stop the nodes with cluster/stop-cluster.sh DIR.
#
# For developers, `seathold dev` does the same natively; this script is for
# operators (test and staging hosts, a local copy of production's layout).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  cat <<EOF
Usage: $(basename "$0") [options] DIR PORT PORT PORT...

Starts one Redis Cluster node per PORT (data, logs and pid file in DIR/PORT)
from a redis.conf template, creates the cluster and waits for
cluster_state:ok. With R replicas per master, the number of ports must be a
multiple of R+1 with at least 3 masters (default: 6 ports, 3 masters, 3
replicas).

Options:
  -c FILE     redis.conf template (default: $here/redis.conf)
  -a FILE     ACL file for the nodes (see $here/acl.conf); users must be
              enabled with passwords. Needs REDIS_ADMIN_PASSWORD and
              REDIS_REPL_PASSWORD in the environment (and optionally
              REDIS_ADMIN_USER, default admin; REDIS_REPL_USER, default
              replicator). Without -a the nodes run without ACLs, which is
              allowed on loopback addresses only.
  -r N        replicas per master (default: 1)
  -H HOST     address to bind and announce (default: 127.0.0.1)
  -o 'NAME VALUE'
              extra redis.conf directive for every node, repeatable
              (e.g. -o 'cluster-node-timeout 2000' -o 'maxmemory 256mb')
  -t SECONDS  how long to wait for the cluster (default: 60)
  -h          this help

Example (local test cluster, 3 masters and 3 replicas):
  $(basename "$0") /tmp/seathold-redis 31000 31001 31002 31003 31004 31005
  seathold serve --redis-nodes redis://127.0.0.1:31000,redis://127.0.0.1:31001
  $(dirname "$0")/stop-cluster.sh /tmp/seathold-redis
EOF
}

started=0
die() {
  echo "start-cluster: $*" >&2
  if ((started)); then
    echo "start-cluster: nodes started so far are still running; stop them with" >&2
    echo "  $here/stop-cluster.sh $dir" >&2
  fi
  exit 1
}

template="$here/redis.conf"
aclfile=""
replicas=1
host=127.0.0.1
wait_s=60
extra=()

while getopts ":c:a:r:H:o:t:h" opt; do
  case "$opt" in
    c) template="$OPTARG" ;;
    a) aclfile="$OPTARG" ;;
    r) replicas="$OPTARG" ;;
    H) host="$OPTARG" ;;
    o) extra+=("$OPTARG") ;;
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

if (($# < 2)); then
  usage >&2
  exit 2
fi
dir="$1"
shift
ports=("$@")

command -v redis-server >/dev/null 2>&1 ||
  die "redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server)"
command -v redis-cli >/dev/null 2>&1 ||
  die "redis-cli is not on PATH (Debian/Ubuntu: apt-get install redis-tools)"

[[ -f "$template" ]] || die "no redis.conf template at $template"
[[ "$replicas" =~ ^[0-9]+$ ]] || die "-r needs a number, not '$replicas'"
[[ "$wait_s" =~ ^[0-9]+$ ]] || die "-t needs a number of seconds, not '$wait_s'"
for port in "${ports[@]}"; do
  if ! [[ "$port" =~ ^[1-9][0-9]*$ ]] || ((port > 55535)); then
    die "bad port '$port' (1-55535: the cluster bus uses port+10000)"
  fi
done
if [[ -n "$(printf '%s\n' "${ports[@]}" | sort | uniq -d)" ]]; then
  die "a port is listed twice"
fi
group=$((replicas + 1))
((${#ports[@]} % group == 0)) ||
  die "${#ports[@]} ports cannot be split into masters with $replicas replicas each"
((${#ports[@]} / group >= 3)) ||
  die "Redis Cluster needs at least 3 masters: give at least $((3 * group)) ports"

cli=(redis-cli -h "$host")
if [[ -n "$aclfile" ]]; then
  [[ -f "$aclfile" ]] || die "no ACL file at $aclfile"
  aclfile="$(cd "$(dirname "$aclfile")" && pwd)/$(basename "$aclfile")"
  [[ -n "${REDIS_ADMIN_PASSWORD:-}" ]] || die "-a needs REDIS_ADMIN_PASSWORD"
  [[ -n "${REDIS_REPL_PASSWORD:-}" ]] || die "-a needs REDIS_REPL_PASSWORD"
  # redis-cli reads the password from REDISCLI_AUTH: it never shows in ps.
  export REDISCLI_AUTH="$REDIS_ADMIN_PASSWORD"
  cli+=(--user "${REDIS_ADMIN_USER:-admin}")
else
  case "$host" in
    127.*) ;;
    *) die "without -a (ACLs) the nodes may only listen on loopback, not $host" ;;
  esac
fi

mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
template="$(cd "$(dirname "$template")" && pwd)/$(basename "$template")"

# Whether something answers on HOST:PORT.
listening() {
  (: <"/dev/tcp/$host/$1") 2>/dev/null
}

# A value as one argument of a Redis configuration line: Redis splits lines
# at spaces, and reads "…" with backslash escapes as one argument.
conf_quote() {
  local s="$1"
  s="${s//\\/\\\\}"
  s="${s//\"/\\\"}"
  printf '"%s"' "$s"
}

# Writes DIR/PORT/node.conf: the template, then what is specific to this
# node. Later directives override earlier ones, except `dir`: Redis changes
# into it while it reads the file, so the template's (a system path such as
# /var/lib/redis, which may not exist or not be writable here) would stop
# the node before this node's own. The template is therefore copied without
# its `dir` lines rather than included; it is copied again at every start.
write_node_conf() {
  local port="$1" node="$dir/$1"
  mkdir -p "$node"
  (
    umask 077
    {
      echo "# Written by start-cluster.sh from $template (without its dir);"
      echo "# edit that file instead and run start-cluster.sh again."
      grep -Ev '^[[:space:]]*dir[[:space:]]' "$template"
      echo "bind $host"
      echo "port $port"
      echo "dir $(conf_quote "$node")"
      echo "cluster-config-file nodes.conf"
      echo "daemonize yes"
      echo "supervised no"
      echo "pidfile $(conf_quote "$node/redis.pid")"
      echo "logfile $(conf_quote "$node/redis.log")"
      if [[ -n "$aclfile" ]]; then
        echo "aclfile $(conf_quote "$aclfile")"
        echo "masteruser $(conf_quote "${REDIS_REPL_USER:-replicator}")"
        echo "masterauth $(conf_quote "$REDIS_REPL_PASSWORD")"
      else
        echo 'aclfile ""'
      fi
      local line
      for line in "${extra[@]}"; do
        echo "$line"
      done
    } >"$node/node.conf"
  )
}

# Existing cluster (every node has a nodes.conf) or a new one (none has)?
existing=0
for port in "${ports[@]}"; do
  [[ -s "$dir/$port/nodes.conf" ]] && existing=$((existing + 1))
done
if ((existing != 0 && existing != ${#ports[@]})); then
  die "only $existing of ${#ports[@]} nodes in $dir have a nodes.conf; refusing to mix old and new nodes"
fi

for port in "${ports[@]}"; do
  if listening "$port" || listening $((port + 10000)); then
    die "$host:$port or its bus port $((port + 10000)) is already in use"
  fi
done

for port in "${ports[@]}"; do
  write_node_conf "$port"
  started=1
  redis-server "$dir/$port/node.conf" ||
    die "redis-server on port $port did not start; see $dir/$port/redis.log"
done

# Waits until CHECK (a command) succeeds, up to the -t limit.
deadline=$((SECONDS + wait_s))
wait_for() {
  local what="$1"
  shift
  until "$@"; do
    if ((SECONDS >= deadline)); then
      die "timed out after ${wait_s}s waiting for $what (logs: $dir/*/redis.log)"
    fi
    sleep 0.2
  done
}

answers_ping() {
  [[ "$("${cli[@]}" -p "$1" ping 2>/dev/null)" == PONG ]]
}
for port in "${ports[@]}"; do
  wait_for "the node on port $port" answers_ping "$port"
done

if ((existing == 0)); then
  nodes=()
  for port in "${ports[@]}"; do
    nodes+=("$host:$port")
  done
  echo "creating the cluster: $((${#ports[@]} / group)) masters, $replicas replica(s) each"
  "${cli[@]}" --cluster create "${nodes[@]}" --cluster-replicas "$replicas" --cluster-yes
else
  echo "restarting an existing cluster from $dir"
fi

cluster_ok() {
  local port
  for port in "${ports[@]}"; do
    "${cli[@]}" -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' ||
      return 1
  done
}
wait_for "cluster_state:ok on every node" cluster_ok

replicas_linked() {
  local port info
  for port in "${ports[@]}"; do
    info="$("${cli[@]}" -p "$port" info replication 2>/dev/null)" || return 1
    if grep -q '^role:slave' <<<"$info"; then
      grep -q '^master_link_status:up' <<<"$info" || return 1
    fi
  done
}
wait_for "every replica to sync with its master" replicas_linked

# Redis 7.0 leaves a replica out of CLUSTER SLOTS until its master has
# gossiped the replica's offset, seconds after the link is up; clients (and
# `seathold doctor`) learn the replicas from CLUSTER SLOTS.
replicas_listed() {
  local port ids=() slots id
  for port in "${ports[@]}"; do
    if "${cli[@]}" -p "$port" info replication 2>/dev/null | grep -q '^role:slave'; then
      ids+=("$("${cli[@]}" -p "$port" cluster myid)") || return 1
    fi
  done
  for port in "${ports[@]}"; do
    slots="$("${cli[@]}" -p "$port" cluster slots 2>/dev/null)" || return 1
    for id in "${ids[@]}"; do
      grep -qx "$id" <<<"$slots" || return 1
    done
  done
}
wait_for "every replica to be listed in CLUSTER SLOTS" replicas_listed

"${cli[@]}" --cluster check "$host:${ports[0]}" >/dev/null ||
  die "redis-cli --cluster check found a problem"

seeds=()
for port in "${ports[@]}"; do
  seeds+=("redis://$host:$port")
done
seedlist="$(
  IFS=,
  echo "${seeds[*]}"
)"
echo "cluster ready: ${#ports[@]} nodes in $dir"
serve="seathold serve --redis-nodes $seedlist"
if [[ -n "$aclfile" ]]; then
  # acl.conf turns the default user off: seathold logs in as its own user.
  serve="SEATHOLD_REDIS_PASSWORD=<the seathold user's password> $serve --redis-username seathold"
fi
if ((replicas == 0)); then
  # No replica can acknowledge a sale: with the default of 1, every confirm
  # would answer 503 not_replicated.
  serve="$serve --confirm-wait-replicas 0"
fi
echo "  $serve"
echo "  stop: $here/stop-cluster.sh $dir"
