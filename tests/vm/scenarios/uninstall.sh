# An uninstall: the agent's DaemonSet deleted (as `helm uninstall` and
# `kubectl delete -k` do), with a token allowed only that. The agent,
# stopped by it, must leave the host as node.sh listed it before the
# install (host_listing), and take its conditions off its Node.
SCENARIO="the agent's DaemonSet deleted (an uninstall)"
WAIT=5
trigger() {
    # The pod's log goes with the pod: keep what the agent says as it stops.
    tail -n 0 -F /var/log/pods/lastgasp_lastgasp-agent-*/agent/*.log > "$OUT/agent-uninstall.log" 2>/dev/null &
    local tailer=$!
    curl -sS --max-time 10 --cacert /var/lib/kubelet/pki/ca.crt \
        -H "Authorization: Bearer $(cat "$IN/node/uninstall.token")" -X DELETE \
        https://10.0.2.100:6443/apis/apps/v1/namespaces/lastgasp/daemonsets/lastgasp-agent
    local gone=no d
    for _ in $(seq 1 900); do
        pgrep -f "$AGENT_PATTERN" > /dev/null || { gone=yes; break; }
        sleep 0.1
    done
    say "AGENT-GONE $gone"
    sleep 1
    kill "$tailer" 2>/dev/null
    grep -h 'uninstalled\|NOT left\|conditions NOT' "$OUT/agent-uninstall.log" | tail -2 | cut -c1-600 \
        | while read -r l; do say "AGENT $l"; done
    host_listing > /run/lastgasp-vm-host-after
    d=$(diff /run/lastgasp-vm-host-before /run/lastgasp-vm-host-after | grep '^[<>]' | paste -sd';')
    say "HOST-DIFF ${d:-none}"
}
