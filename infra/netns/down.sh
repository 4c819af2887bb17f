#!/bin/sh
# Remove the test network: end every process inside a gtn- namespace, then delete the
# namespaces (their veth pairs and the bridge go with them). Safe to run at any time.
set -u
here=$(dirname "$0")
. "$here/env.sh"
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$GTN_PREFIX" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    if [ -n "$pids" ]; then
        kill -TERM $pids 2>/dev/null || true
        sleep 0.5
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns"
done
exit 0
