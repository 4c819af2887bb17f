#!/usr/bin/env bash
# A Redis for the Prefect server's messaging (Debian's redis-server), as root, without systemd: with
# infra/postgres/up.sh, the production set-up docs/operations.md describes ("A Prefect server that
# holds the load"), on 127.0.0.1 only. Prefect's default in-memory messaging holds 10,000 messages
# a subscription and drops the rest under load; Redis streams keep them until they are handled.
#   sudo infra/redis/up.sh     -> prints the Prefect settings that put the server's messaging on it
#   infra/redis/down.sh        -> stops it (REDIS_CLEAN=1 also removes its directory)
# The server also needs the prefect-redis package: pip install 'gpu-tasks[server]'.
# Idempotent: re-running while it is up prints the same settings. A fresh Prefect database needs a
# fresh Redis (another REDIS_DIR and REDIS_PORT): its streams still hold the old database's events.
#
# Env knobs:
#   REDIS_DIR   data, pid and log directory (default /tmp/gpu-tasks-redis)
#   REDIS_PORT  port on 127.0.0.1           (default 56379)
set -euo pipefail

DIR=${REDIS_DIR:-/tmp/gpu-tasks-redis}
PORT=${REDIS_PORT:-56379}

log() { echo "[redis up] $*" >&2; }
die() { echo "[redis up] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs Debian's redis-server and runs it as the redis user)"

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  log "installing redis-server (Debian's packages)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
fi
user=redis
id -u "$user" >/dev/null 2>&1 || user=root

mkdir -p "$DIR"
chown "$user": "$DIR"
chmod 700 "$DIR"
if ! redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null | grep -q PONG; then
  log "starting on 127.0.0.1:$PORT"
  # no snapshots: the messages are consumed within seconds; a restart loses only what was in flight
  runuser -u "$user" -- redis-server --bind 127.0.0.1 --port "$PORT" --protected-mode yes \
    --dir "$DIR" --pidfile "$DIR/redis.pid" --logfile "$DIR/redis.log" --daemonize yes \
    --save "" --appendonly no
  for _ in $(seq 1 100); do
    redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null | grep -q PONG \
    || { tail -20 "$DIR/redis.log" >&2; die "redis did not start"; }
fi
log "ready on 127.0.0.1:$PORT (pid $(cat "$DIR/redis.pid" 2>/dev/null || echo '?'), log $DIR/redis.log)"
cat <<SETTINGS
PREFECT_MESSAGING_BROKER=prefect_redis.messaging
PREFECT_MESSAGING_CACHE=prefect_redis.messaging
PREFECT_SERVER_EVENTS_CAUSAL_ORDERING=prefect_redis.ordering
PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect_redis.lease_storage
PREFECT_REDIS_MESSAGING_HOST=127.0.0.1
PREFECT_REDIS_MESSAGING_PORT=$PORT
SETTINGS
