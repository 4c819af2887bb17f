#!/usr/bin/env bash
# Stop the PostgreSQL infra/postgres/up.sh started; PG_CLEAN=1 also removes its data directory.
set -euo pipefail
DIR=${PG_DIR:-/tmp/gpu-tasks-postgres}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
if [ -n "$bin" ] && [ -f "$DIR/data/PG_VERSION" ]; then
  runuser -u postgres -- "$bin/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null 2>&1 || true
  echo "[postgres down] stopped" >&2
fi
if [ "${PG_CLEAN:-0}" = 1 ]; then rm -rf "$DIR"; fi
