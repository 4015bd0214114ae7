#!/usr/bin/env bash
# A three-node MariaDB Galera cluster on loopback, for the multi-primary tests
# (tests/test_galera.py): .ci/galera.sh start|stop|status.
#
# Its own ports (SQL 3311-3313, Galera 4571-4573, IST 4581-4583, SST
# 4591-4593), its own data directories and its own configuration files
# (--defaults-file, so the server's /etc/mysql configuration is never read):
# the MariaDB on 3306 is not touched. The nodes run a copy of the server
# binary, so that whatever finds that server by its executable
# (start-stop-daemon --exec /usr/sbin/mariadbd, as CI and the fault suite
# start it) never mistakes a node for it.
set -euo pipefail

ROOT=${GALERA_ROOT:-/var/tmp/idempotency-galera}
NODES=(1 2 3)
PROVIDER=${GALERA_PROVIDER:-/usr/lib/galera/libgalera_smm.so}
SERVER=${GALERA_SERVER:-/usr/sbin/mariadbd}
ADDRESS="gcomm://127.0.0.1:4571,127.0.0.1:4572,127.0.0.1:4573"

sql_port() { echo $((3310 + $1)); }

node_sql() {  # node_sql N SQL: run SQL on node N over TCP as root
  mariadb -h 127.0.0.1 -P "$(sql_port "$1")" -u root -N -B -e "$2"
}

write_config() {
  local n=$1 dir=$ROOT/node$1
  cat >"$dir/my.cnf" <<EOF
[mariadbd]
user = mysql
basedir = /usr
datadir = $dir/data
socket = $dir/mysqld.sock
pid-file = $dir/mysqld.pid
log-error = $dir/error.log
port = $(sql_port "$n")
bind-address = 127.0.0.1
skip-name-resolve
character-set-server = utf8mb4
collation-server = utf8mb4_general_ci
performance_schema = OFF
innodb_buffer_pool_size = 64M
innodb_log_file_size = 48M
innodb_flush_log_at_trx_commit = 2
max_connections = 300
binlog_format = ROW
default_storage_engine = InnoDB
innodb_autoinc_lock_mode = 2
wsrep_on = ON
wsrep_provider = $PROVIDER
wsrep_cluster_name = idempotency-ci
wsrep_cluster_address = $ADDRESS
wsrep_node_name = node$n
wsrep_node_address = 127.0.0.1:$((4570 + n))
wsrep_sst_receive_address = 127.0.0.1:$((4590 + n))
wsrep_sst_method = rsync
# A node that rejoins copies from node 3 (node 3 from node 1), so that the
# donor, blocked while it sends, is not a node the tests' servers use.
wsrep_sst_donor = "$( [ "$n" = 3 ] && echo node1, || echo node3, )"
wsrep_provider_options = "gmcast.listen_addr=tcp://127.0.0.1:$((4570 + n));ist.recv_addr=127.0.0.1:$((4580 + n));gcache.size=64M;pc.wait_prim_timeout=PT30S"
EOF
}

wait_until() {  # wait_until SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2; shift 2
  for _ in $(seq $((limit * 4))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.25
  done
  echo "FATAL: $what" >&2
  return 1
}

cluster_size_is_3() { [ "$(node_sql 1 "SHOW STATUS LIKE 'wsrep_cluster_size'" | cut -f2)" = 3 ]; }

node_synced() {
  [ "$(node_sql "$1" "SHOW STATUS LIKE 'wsrep_local_state_comment'" | cut -f2)" = Synced ]
}

start_node() {  # start_node N [--wsrep-new-cluster]
  local n=$1; shift
  local dir=$ROOT/node$n
  (setsid "$ROOT/bin/mariadbd" --defaults-file="$dir/my.cnf" "$@" >>"$dir/stdout.log" 2>&1 &)
  wait_until 120 "node $n did not come up (see $dir/error.log)" node_synced "$n"
}

start() {
  command -v rsync >/dev/null || {
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rsync >/dev/null
  }
  if [ -f "$ROOT/node1/data/grastate.dat" ] && node_sql 1 "SELECT 1" >/dev/null 2>&1; then
    # Running: start the nodes that are down (killed by a test); they rejoin.
    for n in "${NODES[@]}"; do
      if ! node_sql "$n" "SELECT 1" >/dev/null 2>&1; then start_node "$n"; fi
    done
  else
    stop
    rm -rf "$ROOT"
    mkdir -p "$ROOT/bin"
    cp "$SERVER" "$ROOT/bin/mariadbd"
    for n in "${NODES[@]}"; do
      mkdir -p "$ROOT/node$n/data"
      write_config "$n"
    done
    chown -R mysql:mysql "$ROOT"
    # Only node 1 is initialised: the others receive its data by SST.
    mariadb-install-db --defaults-file="$ROOT/node1/my.cnf" --auth-root-authentication-method=normal \
      --skip-test-db >"$ROOT/node1/install.log" 2>&1
    start_node 1 --wsrep-new-cluster
    mariadb --socket="$ROOT/node1/mysqld.sock" -u root -e \
      "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1';
       GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;"
    start_node 2
    start_node 3
  fi
  wait_until 60 "the cluster did not reach three nodes" cluster_size_is_3
  echo "Galera cluster up: SQL on 127.0.0.1:3311-3313"
}

stop() {
  for n in "${NODES[@]}"; do
    local pidfile=$ROOT/node$n/mysqld.pid
    # Only a process that is one of our nodes: a pid file left by a node
    # killed -9 may name a pid now reused by anything else.
    if [ -f "$pidfile" ] && [ "$(readlink "/proc/$(cat "$pidfile")/exe" 2>/dev/null)" = "$ROOT/bin/mariadbd" ]; then
      kill "$(cat "$pidfile")" 2>/dev/null || true
    fi
  done
  for n in "${NODES[@]}"; do
    local pidfile=$ROOT/node$n/mysqld.pid
    for _ in $(seq 240); do
      if [ ! -f "$pidfile" ] || ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then break; fi
      sleep 0.25
    done
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop; echo "Galera cluster stopped" ;;
  status) # Exit 0 only when every node answers Synced.
    synced=0
    for n in "${NODES[@]}"; do
      state=$(node_sql "$n" "SHOW STATUS LIKE 'wsrep_local_state_comment'" 2>/dev/null | cut -f2) || state=""
      printf 'node %s: %s\n' "$n" "${state:-down}"
      if [ "$state" = "Synced" ]; then synced=$((synced + 1)); fi
    done
    [ "$synced" -eq "${#NODES[@]}" ] ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
