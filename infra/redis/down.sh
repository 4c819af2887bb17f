#!/usr/bin/env bash
# Stop the Redis infra/redis/up.sh started; REDIS_CLEAN=1 also removes its directory.
set -euo pipefail
DIR=${REDIS_DIR:-/tmp/gpu-tasks-redis}
PORT=${REDIS_PORT:-56379}
if command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null | grep -q PONG; then
  redis-cli -h 127.0.0.1 -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
  echo "[redis down] stopped" >&2
elif [ -f "$DIR/redis.pid" ]; then
  kill "$(cat "$DIR/redis.pid")" 2>/dev/null || true
fi
if [ "${REDIS_CLEAN:-0}" = 1 ]; then rm -rf "$DIR"; fi
