# An uninstall: the agent's DaemonSet deleted (as `helm uninstall` and
# `kubectl delete -k` do), with a token allowed only that. The agent,
# stopped by it, must leave the host as node.sh listed it before the
# install (host_listing), and take its conditions off its Node.
SCENARIO="the agent's DaemonSet deleted (an uninstall)"
WAIT=5
trigger() {
    curl -sS --max-time 10 --cacert /var/lib/kubelet/pki/ca.crt \
        -H "Authorization: Bearer $(cat "$IN/node/uninstall.token")" -X DELETE \
        https://10.0.2.100:6443/apis/apps/v1/namespaces/lastgasp/daemonsets/lastgasp-agent
    local gone=no d
    for _ in $(seq 1 900); do
        pgrep -f "$AGENT_PATTERN" > /dev/null || { gone=yes; break; }
        sleep 0.1
    done
    say "AGENT-GONE $gone"
    grep -h 'uninstalled' /var/log/pods/lastgasp_lastgasp-agent-*/agent/*.log 2>/dev/null | tail -1 | cut -c1-600 | sed 's/^/AGENT /' | while read -r l; do say "$l"; done
    host_listing > /run/lastgasp-vm-host-after
    d=$(diff /run/lastgasp-vm-host-before /run/lastgasp-vm-host-after | grep '^[<>]' | paste -sd';')
    say "HOST-DIFF ${d:-none}"
}
