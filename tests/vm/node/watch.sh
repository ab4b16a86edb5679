#!/bin/bash
# Started by node.sh with argv[0] "@lastgasp-vm-watch": systemd-shutdown
# spares it, so it outlives the node's services and containers and reports
# on the console when each of them ends: the agent's container, the kubelet
# and containerd (their pids: $1, $2, $3). The host relates those times to the trigger.
# Builtins only in the loop: a forked child would be killed by the sweep.
agent=${1:-0} kubelet=${2:-0} containerd=${3:-0} agent_log=${4:-}
say() { local t=${EPOCHREALTIME/./}; echo "lastgasp-vm: ${t}000 $*" > /dev/kmsg; }
alive() { [ "$1" != 0 ] && kill -0 "$1" 2>/dev/null; }
mkfifo /run/lastgasp-vm-watch.fifo 2>/dev/null
exec 3<>/run/lastgasp-vm-watch.fifo
say "WATCH agent=$agent kubelet=$kubelet containerd=$containerd"
: > /run/lastgasp-vm-watch.ready
gone_a= gone_k= gone_c=
# The agent's own log from here on (its container's log file, read to its
# end first): its lines about shutdown signals, the last gasp and the
# shutdown hook go to the console too.
if [ -n "$agent_log" ] && exec 4<"$agent_log"; then
    while read -r -u 4 _; do :; done
else
    agent_log=
fi
while :; do
    if [ -n "$agent_log" ]; then
        while read -r -t 0.01 -u 4 l; do
            case "$l" in
                *"shutdown signal"*|*"last gasp"*|*"hook"*|*"last word"*) say "AGENT ${l:0:400}" ;;
            esac
        done
    fi
    if [ -z "$gone_a" ] && ! alive "$agent"; then gone_a=1; [ "$agent" != 0 ] && say "GONE agent"; fi
    if [ -z "$gone_k" ] && ! alive "${kubelet:-0}"; then gone_k=1; say "GONE kubelet"; fi
    if [ -z "$gone_c" ] && ! alive "${containerd:-0}"; then gone_c=1; say "GONE containerd"; fi
    read -r -t 0.02 -u 3 _
done
