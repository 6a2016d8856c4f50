#!/usr/bin/env bash
# A local Redis/Valkey Cluster on loopback for tests, CI and `bench --only cluster`:
# 3 primaries + 3 replicas (`--cluster create --cluster-replicas 1`), each node on a free
# 127.0.0.1 port, no persistence, in a directory of its own.
#
#   scripts/redis_cluster.sh start DIR [NODES [REPLICAS]]   # prints the seed URL "redis://127.0.0.1:PORT"
#   scripts/redis_cluster.sh stop DIR                       # kills every node it started there
#
# DIR/nodes.txt lists "port pid" per node (tests kill and restart single nodes with it);
# DIR/url holds the seed URL; DIR/node-PORT.log each node's log.
# Uses valkey-server/valkey-cli when installed (Debian trixie+, the Valkey images), else
# redis-server/redis-cli (Debian bookworm's 7.0: same cluster protocol, same commands).
# Extra node options: REDIS_CLUSTER_ARGS="--maxmemory 64mb" (word-split).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [[ -z "$cmd" || -z "$dir" ]]; then
  echo "usage: $0 start DIR [NODES [REPLICAS]] | stop DIR" >&2
  exit 2
fi

if command -v valkey-server >/dev/null 2>&1; then
  server=valkey-server cli=valkey-cli
else
  server=redis-server cli=redis-cli
fi

stop() {
  [[ -f "$dir/nodes.txt" ]] || return 0
  while read -r port pid; do
    kill -9 "$pid" 2>/dev/null || true
  done < "$dir/nodes.txt"
  while read -r port pid; do
    for _ in $(seq 100); do  # gone, or a zombie (no init reaps it in a container)
      [[ -r /proc/$pid/stat ]] && [[ $(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null) != Z ]] || break
      sleep 0.05
    done
  done < "$dir/nodes.txt"
  rm -f "$dir/nodes.txt" "$dir/url"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

case "$cmd" in
  stop)
    stop
    ;;
  start)
    nodes=${3:-6}
    replicas=${4:-1}
    if ! command -v "$server" >/dev/null 2>&1; then
      echo "$0: neither valkey-server nor redis-server is installed (Debian: apt-get install -y redis-server)" >&2
      exit 3
    fi
    mkdir -p "$dir"
    stop
    : > "$dir/nodes.txt"
    addrs=()
    for i in $(seq "$nodes"); do
      # Cluster nodes also listen on port+10000 (the bus): pick ports whose bus port is free too.
      while :; do
        port=$(free_port)
        if (( port + 10000 < 65536 )) && python3 -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',$port+10000)); s.close()" 2>/dev/null; then
          break
        fi
      done
      nd="$dir/n$port"
      mkdir -p "$nd"
      # shellcheck disable=SC2086
      "$server" --bind 127.0.0.1 --port "$port" --cluster-enabled yes --cluster-config-file "$nd/nodes.conf" \
        --cluster-node-timeout "${REDIS_CLUSTER_NODE_TIMEOUT_MS:-1000}" --cluster-replica-validity-factor 0 \
        --repl-diskless-sync-delay 0 --save "" --appendonly no --dir "$nd" \
        --daemonize no --protected-mode no ${REDIS_CLUSTER_ARGS:-} > "$dir/node-$port.log" 2>&1 &
      echo "$port $!" >> "$dir/nodes.txt"
      addrs+=("127.0.0.1:$port")
    done
    for a in "${addrs[@]}"; do
      for _ in $(seq 200); do "$cli" -h 127.0.0.1 -p "${a#*:}" ping >/dev/null 2>&1 && break; sleep 0.05; done
    done
    "$cli" --cluster create "${addrs[@]}" --cluster-replicas "$replicas" --cluster-yes > "$dir/create.log" 2>&1 || {
      cat "$dir/create.log" >&2; stop; exit 1; }
    # Ready when every node says cluster_state:ok and sees every slot assigned.
    for a in "${addrs[@]}"; do
      for _ in $(seq 400); do
        if "$cli" -h 127.0.0.1 -p "${a#*:}" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; then break; fi
        sleep 0.05
      done
    done
    # ... and every replica has synced with its primary (a failover needs a replica with the data).
    for a in "${addrs[@]}"; do
      for _ in $(seq 400); do
        info=$("$cli" -h 127.0.0.1 -p "${a#*:}" info replication 2>/dev/null || true)
        if grep -q '^role:master' <<< "$info" || grep -q '^master_link_status:up' <<< "$info"; then break; fi
        sleep 0.05
      done
    done
    echo "redis://${addrs[0]}" > "$dir/url"
    echo "$server $("$server" --version | grep -o 'v=[0-9.]*')" > "$dir/server"
    cat "$dir/url"
    ;;
  *)
    echo "usage: $0 start DIR [NODES [REPLICAS]] | stop DIR" >&2
    exit 2
    ;;
esac
