# A real Kubernetes node in the guest, for `cargo xtask vm-test --node`
# (sourced by runner.sh when the share carries in/node.env). containerd (with
# runc and the CNI bridge) and the kubelet v1.32.13 join the real control
# plane on the host, reached at 10.0.2.100:6443 through qemu's guestfwd.
# Images come from OCI archives on the share (no registry). The agent, when
# the arm has it, is the DaemonSet's pod; the host unit is not started.
#
# node.env sets ARM (lastgasp | kubelet | both) and EXPECT_TASKS (the
# containers that must run: the agent's, if any, and the workloads').

# The `kubernetes` Service (10.0.0.1:443) as kube-proxy would route it: the
# agent's in-cluster configuration points there.
node_network() {
    modprobe br_netfilter 2>/dev/null
    iptables -t nat -A OUTPUT -d 10.0.0.1/32 -p tcp --dport 443 -j DNAT --to-destination 10.0.2.100:6443 \
        || say "FAIL iptables: no DNAT for the kubernetes Service"
}

node_files() {
    mkdir -p /etc/containerd /etc/cni/net.d /var/lib/kubelet/pki /run/systemd/system
    cp "$IN/node/containerd.toml" /etc/containerd/config.toml
    cp "$IN/node/cni.conflist" /etc/cni/net.d/10-lastgasp.conflist
    cp "$IN/node/kubelet.yaml" /var/lib/kubelet/config.yaml
    cp "$IN/node/kubeconfig" /var/lib/kubelet/kubeconfig
    cp "$IN/node/ca.crt" "$IN/node/kubelet.crt" "$IN/node/kubelet.key" /var/lib/kubelet/pki/
    cp "$IN/node/kubelet.service" /run/systemd/system/kubelet.service
    # The binaries run from the root file system: the share may go first
    # in a shutdown.
    # PRELOADED=1: the kubelet is on the disk already (node_preload).
    [ "${PRELOADED:-0}" = 1 ] || cp "$IN/node/kubelet" /usr/local/bin/kubelet
    cp "$IN/lastgasp" /usr/local/sbin/lastgasp
    cp "$IN/node/watch.sh" /usr/local/sbin/lastgasp-vm-watch
    chmod 755 /usr/local/bin/kubelet /usr/local/sbin/lastgasp
}

# What lastgasp may write on the host, and logind's delay: listed before
# the install (node_up) and after an uninstall (scenario uninstall).
host_listing() {
    local d
    for d in /usr/lib/systemd/system-shutdown /run/systemd/system /etc/systemd/logind.conf.d \
        /run/lastgasp /var/lib/lastgasp/courier; do
        [ -e "$d" ] && find "$d"
    done | sort
    echo "logind $(busctl get-property org.freedesktop.login1 /org/freedesktop/login1 \
        org.freedesktop.login1.Manager InhibitDelayMaxUSec 2>&1)"
}

# The images: already in containerd's store on the disk the cell boots from
# (PRELOADED=1, imported once per run by node_preload: 1-2 min each under
# TCG), and then they must be this run's; or imported from the share's OCI
# archives.
node_images() {
    local a
    if [ "${PRELOADED:-0}" = 1 ]; then
        if cmp -s "$IN/node/images.sum" /var/lib/lastgasp-vm/images.sum; then
            say "IMAGES preloaded $(cut -c1-16 /var/lib/lastgasp-vm/images.sum)"
            return 0
        fi
        say "FAIL the disk's preloaded images are not this run's: $(cat /var/lib/lastgasp-vm/images.sum 2>&1)"
        return 1
    fi
    for a in "$IN"/node/images/*.tar; do
        ctr -n k8s.io images import --no-unpack=false "$a" >> "$OUT/node-images-boot$boot.log" 2>&1 \
            || { say "FAIL ctr import $(basename "$a")"; return 1; }
    done
    # What the DaemonSet names (lastgasp:0.1.0) is docker.io/library/... to
    # the CRI; the archive calls it localhost/lastgasp:VERSION.
    ctr -n k8s.io images ls -q >> "$OUT/node-images-boot$boot.log"
    while read -r from to; do
        ctr -n k8s.io images tag --force "$from" "$to" >> "$OUT/node-images-boot$boot.log" 2>&1
    done < "$IN/node/tags"
    say "IMAGES imported"
}

# PRELOAD=1: the images and the kubelet, into the root disk every cell then
# boots from.
node_preload() {
    mkdir -p /etc/containerd /var/lib/lastgasp-vm
    cp "$IN/node/containerd.toml" /etc/containerd/config.toml
    cp "$IN/node/kubelet" /usr/local/bin/kubelet
    chmod 755 /usr/local/bin/kubelet
    systemctl start containerd || { say "FAIL containerd did not start"; finish fail; }
    node_images || finish fail
    systemctl stop containerd
    cp "$IN/node/images.sum" /var/lib/lastgasp-vm/images.sum
    sync
    say "PRELOADED $(cut -c1-16 /var/lib/lastgasp-vm/images.sum)"
    finish preloaded
}

# Containers running under containerd's k8s.io namespace (pods' sandboxes
# are tasks too: only the named containers count, from node.env).
node_tasks() {
    ctr -n k8s.io tasks ls 2>/dev/null | awk '$3 == "RUNNING"' | wc -l
}

# Until the agent's container says "armed" (arms with the agent) and the
# expected tasks run; then ARMED.
node_up() {
    # RO_USR=1 (`vm-test --node --ro-usr`): /usr read-only, as on Flatcar,
    # Bottlerocket or COS (the binaries above are already in place).
    if [ "${RO_USR:-0}" = 1 ]; then
        mount --bind /usr /usr && mount -o remount,bind,ro /usr \
            || { say "FAIL /usr not made read-only"; finish fail; }
        if touch /usr/lib/systemd/.lastgasp-rw 2>/dev/null; then
            say "FAIL /usr still writable"; finish fail
        fi
        # /run as those OSes mount it (dracut, systemd: not noexec; Debian's
        # initramfs-tools adds noexec), where the agent puts the courier.
        mount -o remount,exec /run || say "FAIL /run not remounted exec"
        say "USR-READ-ONLY $(findmnt -no OPTIONS /usr) RUN $(findmnt -no OPTIONS /run)"
    fi
    systemctl daemon-reload
    host_listing > /run/lastgasp-vm-host-before
    systemctl start containerd || { say "FAIL containerd did not start"; finish fail; }
    node_images || finish fail
    systemctl start kubelet || { say "FAIL the kubelet did not start"; finish fail; }
    say "KUBELET-STARTED"
    # Bounded by time, not by rounds (a round takes 0.3-1 s under TCG): the
    # diagnosis below must be written before the host's ARMED timeout (420 s
    # from the runner's start, which $SECONDS counts from), however long the
    # images took to import.
    # After a power-off the workloads run elsewhere (replaced while the node
    # was down): on a later boot only the agent's pod is waited for.
    local expect=$EXPECT_TASKS
    if [ "$boot" -gt 1 ]; then
        if [ "$ARM" = kubelet ]; then expect=0; else expect=1; fi
    fi
    local armed= until=360
    while [ "$SECONDS" -lt "$until" ]; do
        if [ "$ARM" = kubelet ] || grep -qs '"armed"\|lastgasp: armed\| armed ' /var/log/pods/lastgasp_lastgasp-agent-*/agent/*.log; then
            if [ "$(node_tasks)" -ge "$expect" ]; then armed=1; break; fi
        fi
        systemctl is-active -q kubelet || break
        sleep 0.2
    done
    # The API server must see the pods Running (the kubelet reports them
    # seconds after containerd runs them) and the second node up: the host
    # writes in/cluster-ready then.
    if [ -n "$armed" ]; then
        armed=
        while [ "$SECONDS" -lt "$until" ]; do
            [ -e "$IN/cluster-ready" ] && { armed=1; break; }
            sleep 0.5
        done
        [ -n "$armed" ] || say "FAIL the API server never had the node's pods Running (no in/cluster-ready)"
    fi
    { ctr -n k8s.io tasks ls; ls -l /var/log/pods/; free -m; systemd-inhibit --list --no-pager; } \
        > "$OUT/node-state-boot$boot.txt" 2>&1
    if [ -z "$armed" ]; then
        { systemctl status --no-pager -l kubelet containerd; journalctl -b --no-pager -n 200 -u kubelet -u containerd;
          tail -n 50 /var/log/pods/*/*/*.log; } > "$OUT/node-diag-boot$boot.log" 2>&1
        say "FAIL the node's pods did not start (out/node-diag-boot$boot.log)"
        finish fail
    fi
    local agent kubelet containerd
    # As `@lastgasp run` (spared by systemd-shutdown's final kill), or by its
    # path: runner.sh's AGENT_PATTERN.
    agent=$(pgrep -f "$AGENT_PATTERN" | head -1)
    kubelet=$(pgrep -x kubelet | head -1)
    containerd=$(pgrep -x containerd | head -1)
    cat /var/log/pods/lastgasp_lastgasp-agent-*/agent/*.log > "$OUT/agent-pod-boot$boot.log" 2>/dev/null
    # Where the agent's container and the kubelet die, against the shutdown:
    # a root process whose argv[0] starts with '@' outlives systemd-shutdown's
    # kill sweep (vm-guest.md), so it sees them go and says so on the console.
    rm -f /run/lastgasp-vm-watch.ready
    systemd-run --quiet --unit lastgasp-vm-watch -p DefaultDependencies=no \
        bash -c 'exec -a @lastgasp-vm-watch bash /usr/local/sbin/lastgasp-vm-watch "$0" "$1" "$2" "$3"' \
        "${agent:-0}" "${kubelet:-0}" "${containerd:-0}" \
        "$(ls /var/log/pods/lastgasp_lastgasp-agent-*/agent/*.log 2>/dev/null | head -1)"
    for _ in $(seq 1 100); do [ -e /run/lastgasp-vm-watch.ready ] && break; sleep 0.1; done
    say "ARMED node arm=$ARM agent=${agent:-none} tasks=$(node_tasks) mem_used_mib=$(free -m | awk '/^Mem:/ {print $3}') inhibitors=$(systemd-inhibit --list --no-pager --no-legend 2>/dev/null | awk '{print $1}' | paste -sd+)"
}

# The agent's DaemonSet deleted (as `helm uninstall` and `kubectl delete -k`
# do), with a token allowed only that: the agent, stopped by it, must leave
# the host as host_listing saw it before the install. Scenarios uninstall
# and drill-uninstall.
node_uninstall() {
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
