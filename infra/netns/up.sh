#!/bin/sh
# Build the private test network: a bridge in namespace gtn-net and one namespace per host
# (gtn-sched, gtn-flow, gtn-gpu1, gtn-gpu2), each joined to the bridge by a veth pair whose
# host end is that namespace's eth0, with an address of 10.213.77.0/24 (see env.sh).
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN). Removes leftovers of an aborted run first.
# Run processes on a host with exec.sh HOST COMMAND...; remove everything with down.sh.
set -eu
here=$(dirname "$0")
. "$here/env.sh"
"$here/down.sh"
if ip -4 addr show | grep -q "inet $GTN_NET\."; then
    echo "up.sh: $GTN_NET.0/24 is already in use in this namespace; refusing to build it" >&2
    exit 1
fi
ip netns add "$GTN_BRIDGE_NS"
ip -n "$GTN_BRIDGE_NS" link set lo up
ip -n "$GTN_BRIDGE_NS" link add "$GTN_BRIDGE" type bridge
ip -n "$GTN_BRIDGE_NS" link set "$GTN_BRIDGE" up
for entry in $GTN_HOSTS; do
    host=${entry%%:*}
    octet=${entry#*:}
    ns="$GTN_PREFIX$host"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # both ends are made inside the host's namespace: nothing of it ever exists in the root one
    ip -n "$ns" link add eth0 type veth peer name "gtn-$host-br"
    ip -n "$ns" link set "gtn-$host-br" netns "$GTN_BRIDGE_NS"
    ip -n "$GTN_BRIDGE_NS" link set "gtn-$host-br" master "$GTN_BRIDGE" up
    ip -n "$ns" addr add "$GTN_NET.$octet/24" dev eth0
    ip -n "$ns" link set eth0 up
done
echo "up.sh: hosts $GTN_HOSTS on $GTN_NET.0/24 (bridge $GTN_BRIDGE in $GTN_BRIDGE_NS)"
