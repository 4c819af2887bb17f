#!/usr/bin/env bash
# Stop the single-node Slurm started by infra/slurm/up.sh; leave no process behind.
# Leaves packages, config and logs in place.
set -uo pipefail
DIR=${SLURM_CI_DIR:-/tmp/gpu-tasks-slurm}
log() { echo "[slurm down] $*" >&2; }

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
pidof_file() { [ -f "$1" ] && cat "$1" || true; }

# wait until pid is gone, SIGKILL after $2 seconds
reap() {
    local pid=$1 t=${2:-10} i
    for ((i = 0; i < t * 10; i++)); do alive "$pid" || return 0; sleep 0.1; done
    log "pid $pid still alive after ${t}s, SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
}

ctld=$(pidof_file "$DIR/slurmctld.pid")
slurmd=$(pidof_file "$DIR/slurmd.pid")

# 1. cancel all jobs and wait for them to leave the node (so slurmstepd/job
#    processes are cleaned up by slurmd itself)
if alive "$ctld"; then
    scancel --full --quiet -u root 2>/dev/null || true
    scancel --full --quiet 2>/dev/null || scancel --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    for _ in $(seq 100); do
        [ -z "$(squeue -h -t all -o %i 2>/dev/null)" ] && break
        [ -z "$(pgrep -x slurmstepd || true)" ] && [ -z "$(squeue -h -o %i -t R,CG 2>/dev/null)" ] && break
        sleep 0.2
    done
fi

# 2. stop slurmd then slurmctld (SIGTERM, pid files only)
for pid in "$slurmd" "$ctld"; do
    if alive "$pid"; then kill -TERM "$pid" 2>/dev/null || true; reap "$pid" 15; fi
done

# 3. leftover step daemons (children of the slurmd we stopped)
for pid in $(pgrep -x slurmstepd || true); do
    kill -TERM "$pid" 2>/dev/null || true; reap "$pid" 5
done

# 4. munged
mpid=$(pidof_file /run/munge/munged.pid)
if alive "$mpid"; then kill -TERM "$mpid" 2>/dev/null || true; reap "$mpid" 10; fi

left=""
for n in slurmctld slurmd slurmstepd munged; do left+=$(pgrep -a -x "$n" || true); done
if [ -n "$left" ]; then
    log "WARNING: processes left: $left"; exit 1
fi
log "stopped"
