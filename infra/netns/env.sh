# Names and addresses of the test network (sourced by up.sh, down.sh and exec.sh).
# Everything is prefixed gtn- and every address is in GTN_NET, which exists only inside
# these namespaces: the root namespace gets no address, no route and no listener.
GTN_PREFIX=gtn-
GTN_NET=10.213.77
GTN_BRIDGE_NS=gtn-net
GTN_BRIDGE=gtn-br0
# host name -> last octet of its address
GTN_HOSTS="sched:2 flow:10 gpu1:11 gpu2:12"
