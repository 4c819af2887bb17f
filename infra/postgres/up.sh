#!/usr/bin/env bash
# A PostgreSQL for the Prefect server (Debian's packages), as root, without systemd: the production
# set-up docs/operations.md describes ("A Prefect server that holds the load"), on 127.0.0.1 only.
#   sudo infra/postgres/up.sh            -> prints PREFECT_API_DATABASE_CONNECTION_URL=...
#   infra/postgres/down.sh               -> stops it (the data directory stays unless PG_CLEAN=1)
# Then: PREFECT_API_DATABASE_CONNECTION_URL=<printed> prefect server start --host 127.0.0.1
# Idempotent: re-running while it is up prints the same URL.
#
# Env knobs:
#   PG_DIR   data and log directory   (default /tmp/gpu-tasks-postgres)
#   PG_PORT  port on 127.0.0.1        (default 55432)
#   PG_DB    database, role, password (default prefect)
set -euo pipefail

DIR=${PG_DIR:-/tmp/gpu-tasks-postgres}
PORT=${PG_PORT:-55432}
DB=${PG_DB:-prefect}

log() { echo "[postgres up] $*" >&2; }
die() { echo "[postgres up] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs Debian's postgresql and runs it as the postgres user)"

bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
  log "installing postgresql (Debian's packages)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
fi
as_pg() { runuser -u postgres -- "$@"; }

mkdir -p "$DIR"
chown postgres: "$DIR"
chmod 700 "$DIR"
if [ ! -f "$DIR/data/PG_VERSION" ]; then
  log "initdb in $DIR/data"
  as_pg "$bin/initdb" -D "$DIR/data" -U postgres --auth-local=trust --auth-host=scram-sha-256 >/dev/null
fi
if ! as_pg "$bin/pg_ctl" -D "$DIR/data" status >/dev/null 2>&1; then
  log "starting on 127.0.0.1:$PORT"
  # a socket directory of its own (Debian's /var/run/postgresql may not exist without the service);
  # max_connections: a Prefect server opens a pool per process, and the benchmarks run several
  as_pg "$bin/pg_ctl" -D "$DIR/data" -l "$DIR/postgres.log" -w -t 60 start \
    -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR -c max_connections=200" >/dev/null \
    || { tail -20 "$DIR/postgres.log" >&2; die "postgres did not start"; }
fi
psql_() { as_pg psql -h "$DIR" -p "$PORT" -U postgres -v ON_ERROR_STOP=1 -qtA "$@"; }
if [ -z "$(psql_ -c "SELECT 1 FROM pg_roles WHERE rolname = '$DB'")" ]; then
  psql_ -c "CREATE ROLE $DB LOGIN PASSWORD '$DB'"
fi
if [ -z "$(psql_ -c "SELECT 1 FROM pg_database WHERE datname = '$DB'")" ]; then
  psql_ -c "CREATE DATABASE $DB OWNER $DB"
fi
log "ready: database $DB on 127.0.0.1:$PORT (data in $DIR/data)"
echo "PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://$DB:$DB@127.0.0.1:$PORT/$DB"
