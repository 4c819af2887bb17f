#!/bin/sh
# exec.sh HOST COMMAND...: run COMMAND on test host HOST (sched, flow, gpu1, gpu2): in its
# network namespace gtn-HOST, with a UTS namespace of its own whose host name is gtn-HOST.
set -eu
host=$1
shift
exec ip netns exec "gtn-$host" unshare --uts sh -c 'hostname "$0" && exec "$@"' "gtn-$host" "$@"
