#!/bin/bash
# Guest side of `cargo xtask vm-test`, started at every boot by
# lastgasp-vm.service (baked into the image). It starts the agent as a
# systemd service, then on the first boot runs the scenario's trigger; on a
# later boot (after a reboot or kexec) it collects `lastgasp history --boot
# previous` and ends the guest.
#
# Reports go to the host two ways: /mnt/lastgasp/out (9p, written through at
# once) and /dev/kmsg, which the kernel prints on the serial console that the
# host timestamps as it arrives. The audit log itself lives on /dev/vdb.
set -u
IN=/mnt/lastgasp/in
OUT=/mnt/lastgasp/out
AUDIT=/var/lib/lastgasp
# The agent's process in a pod: it names itself @lastgasp (systemd's mark
# for what outlives the final kill).
AGENT_PATTERN='^(@lastgasp|/usr/local/bin/lastgasp) .*run'

now() { date +%s%N; }
say() {
    local t
    t=$(now)
    echo "$t $*" >> "$OUT/timeline"
    echo "lastgasp-vm: $t $*" > /dev/kmsg
}

# Ends the guest for the harness (not a scenario): the agent is stopped
# first, so nothing of this is audited, and the audit disk unmounted.
finish() {
    say "END $1"
    systemctl stop lastgasp.service
    # A real node: the kubelet first (it would restart the agent's pod),
    # then the agent's container, which writes its last records on SIGTERM.
    if [ -f "$IN/node.env" ]; then
        systemctl stop lastgasp-vm-watch.service kubelet.service 2>/dev/null
        pkill -TERM -f "$AGENT_PATTERN" 2>/dev/null
        for _ in $(seq 1 50); do pgrep -f "$AGENT_PATTERN" > /dev/null || break; sleep 0.1; done
    fi
    umount "$AUDIT" 2>/dev/null
    sync
    systemctl poweroff --force --force
    sleep 60
}

# The API double's request log (cluster mode), from its test endpoint.
double_log() {
    exec 3<>/dev/tcp/10.0.2.100/8099 || return 1
    printf 'GET /_double/log HTTP/1.0\r\nHost: 10.0.2.100\r\nUser-Agent: lastgasp-vm-runner\r\nConnection: close\r\n\r\n' >&3
    # qemu's guestfwd does not always pass the double's close on: the whole
    # (small) log is there well within 3 s.
    timeout 3 cat <&3
    exec 3<&-
}

boot_id=$(cat /proc/sys/kernel/random/boot_id)
echo "$boot_id" >> "$OUT/boots"
boot=$(wc -l < "$OUT/boots")

# shellcheck source=/dev/null
. "$IN/scenario.sh"
WAIT=${WAIT:-240}

timeout 300 systemctl is-system-running --wait > /dev/null 2>&1
say "BOOT $boot $boot_id uptime=$(cut -d' ' -f1 /proc/uptime)s kernel=$(uname -r)"

mountpoint -q "$AUDIT" || mount "$AUDIT" || { say "FAIL cannot mount the audit disk /dev/vdb on $AUDIT"; finish fail; }

# Cluster mode (`vm-test --cluster`): the only network is qemu's user NIC,
# restricted to the API double's forward.
if [ -f "$IN/lastgasp.env" ]; then
    cp "$IN/kubeconfig" /run/kubeconfig.lastgasp
    cp "$IN/lastgasp.yaml" /run/lastgasp.yaml
    cp "$IN/ca.crt" /run/lastgasp-ca.crt
fi
# systemd-networkd with DHCP from qemu's own server (10.0.2.15 via 10.0.2.2).
net_networkd() {
    mkdir -p /run/systemd/network
    printf '[Match]\nName=%s\n\n[Network]\nDHCP=ipv4\n' "$1" > /run/systemd/network/10-lastgasp.network
    systemctl start systemd-networkd || return 1
    for _ in $(seq 1 300); do
        ip route show default | grep -q via && return 0
        sleep 0.1
    done
    return 1
}

# As Debian's ifupdown networking.service: up at start, `ifdown -a` (the
# address and the link down) when stopped, ordered before network.target.
net_ifupdown() {
    mkdir -p /run/systemd/system
    cat > /run/systemd/system/lastgasp-vm-networking.service <<UNIT
[Unit]
Description=ifupdown-like networking (the VM harness)
DefaultDependencies=no
Wants=network.target
Before=network.target shutdown.target network-online.target
Conflicts=shutdown.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'ip link set $1 up && ip addr add 10.0.2.15/24 dev $1 && ip route add default via 10.0.2.2'
ExecStop=/bin/sh -c 'ip addr flush dev $1; ip link set $1 down; echo "lastgasp-vm: ifdown $1" > /dev/kmsg'
UNIT
    systemctl daemon-reload && systemctl start lastgasp-vm-networking.service
}

if [ -f "$IN/lastgasp.env" ] || [ -f "$IN/node.env" ]; then
    # The virtio NIC can appear, or be renamed by udev (eth0 -> ens*), after
    # the runner starts: seen twice in 18 real-node boots.
    udevadm settle --timeout=10 2>/dev/null
    nic=
    for _ in $(seq 1 100); do
        nic=$(ls /sys/class/net | grep -v '^lo$' | head -1)
        [ -n "$nic" ] && break
        sleep 0.1
    done
    # The real node's network as `vm-test --node --network` asks.
    case "$(sed -n 's/^NETWORK=//p' "$IN/node.env" 2>/dev/null)" in
    networkd-dhcp) net_networkd "$nic" ;;
    ifupdown) net_ifupdown "$nic" ;;
    *) ip link set "$nic" up && ip addr add 10.0.2.15/24 dev "$nic" && ip route add default via 10.0.2.2 ;;
    esac || say "FAIL no network for cluster mode (nic '$nic')"
    say "NETWORK $(ip -4 -o addr show dev "$nic" | awk '{print $4}') via $(ip route show default | awk '{print $3}')"
fi

# A real node (`vm-test --node`): containerd and the kubelet; the agent, if
# the arm has it, is the DaemonSet's pod (tests/vm/guest/node.sh).
if [ -f "$IN/node.env" ]; then
    # shellcheck source=/dev/null
    . "$IN/node.env"
    # shellcheck source=node.sh
    . "$IN/node.sh"
    # The images' own boot (vm::node::preload): imported, then powered off.
    [ "${PRELOAD:-0}" = 1 ] && node_preload
    node_network
    node_files
    node_up
fi

# The agent, as the unit the host put on the share.
[ -f "$IN/node.env" ] || {
mkdir -p /run/systemd/system
cp "$IN/lastgasp.service" /run/systemd/system/lastgasp.service
# A scenario may set the agent's environment (AGENT_ENV="VAR=value ...").
if [ -n "${AGENT_ENV:-}" ]; then
    mkdir -p /run/systemd/system/lastgasp.service.d
    printf '[Service]\nEnvironment=%s\n' "$AGENT_ENV" > /run/systemd/system/lastgasp.service.d/scenario.conf
fi
systemctl daemon-reload
agent_diag() {
    { systemctl status --no-pager -l lastgasp.service; journalctl -b --no-pager -n 60 -u lastgasp.service; } \
        > "$OUT/agent-diag-boot$boot.log" 2>&1
}
if ! systemctl start lastgasp.service; then
    agent_diag
    say "FAIL the lastgasp service did not start (out/agent-diag-boot$boot.log)"
    finish fail
fi
armed=
for _ in $(seq 1 1200); do
    if dmesg | grep -q 'lastgasp: armed'; then armed=1; break; fi
    # (its cgroup, not `systemctl is-active`: the agent audits every systemctl exec)
    # (cgroup files have no size: test their content, not -s)
    if ! grep -q . /sys/fs/cgroup/system.slice/lastgasp.service/cgroup.procs 2>/dev/null; then break; fi
    sleep 0.1
done
if [ -z "$armed" ]; then
    agent_diag
    say "FAIL the agent did not arm (out/agent-diag-boot$boot.log)"
    finish fail
fi
# No systemctl from here on: the agent audits every exec of it.
pid=$(head -1 /sys/fs/cgroup/system.slice/lastgasp.service/cgroup.procs)
grep -E '^(Uid|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs):' "/proc/$pid/status" > "$OUT/agent-status-boot$boot"
tr '\0' ' ' < "/proc/$pid/cmdline" > "$OUT/agent-cmdline-boot$boot"
say "ARMED pid=$pid argv0=$(tr '\0' '\n' < "/proc/$pid/cmdline" | head -1)"
}

if [ "$boot" -gt 1 ]; then
    # What the node reports about its last shutdown once it is back.
    /usr/local/sbin/lastgasp history --audit-dir "$AUDIT" --boot previous \
        > "$OUT/history-boot$boot.jsonl" 2> "$OUT/history-boot$boot.err"
    say "HISTORY boot=$boot records=$(wc -l < "$OUT/history-boot$boot.jsonl")"
    # Cluster mode: the agent reports the previous boot to the cluster as it
    # starts (a PreviousBoot Event, then the last gasp delivered late if it
    # never left); stopping it earlier would race that report. Wait until
    # the API double has logged the Event (its test endpoint, read-only),
    # then up to 5 s for a late record, before ending the guest.
    # A real node: the agent's pod reports the previous boot as it starts
    # and clears its marks once the kubelet says Ready; wait for the Node
    # to be Ready without the agent's taint (read with the kubelet's own
    # credentials: the Node authorizer lets it read its Node).
    if [ -f "$IN/node.env" ]; then
        back=no
        for _ in $(seq 1 120); do
            curl -s --max-time 5 --cacert /var/lib/kubelet/pki/ca.crt --cert /var/lib/kubelet/pki/kubelet.crt \
                --key /var/lib/kubelet/pki/kubelet.key "https://10.0.2.100:6443/api/v1/nodes/$(hostname)" \
                > "$OUT/node-after-boot$boot.json" 2>/dev/null
            # The API server pretty-prints: one field per line.
            node_json=$(tr -d ' \n' < "$OUT/node-after-boot$boot.json")
            if [[ $node_json == *'"type":"Ready","status":"True"'* ]] \
                && [[ $node_json != *lastgasp.dev/shutting-down* ]] \
                && { [ "$ARM" = kubelet ] || grep -qs 'previous boot' /var/log/pods/lastgasp_lastgasp-agent-*/agent/*.log; }; then
                back=yes
                break
            fi
            sleep 1
        done
        # The controller lifts its fence on its next pass.
        sleep 5
        say "REPORTED node-back=$back"
    fi
    if [ -f "$IN/lastgasp.env" ]; then
        reported=no
        for _ in $(seq 1 60); do
            double_log > "$OUT/double-log-boot$boot" 2>/dev/null
            if grep -q PreviousBoot "$OUT/double-log-boot$boot"; then reported=yes; break; fi
            sleep 1
        done
        if [ "$reported" = yes ]; then
            for _ in $(seq 1 10); do
                grep -q delivered_late "$OUT/double-log-boot$boot" && break
                sleep 0.5
                double_log > "$OUT/double-log-boot$boot" 2>/dev/null
            done
        fi
        rm -f "$OUT/double-log-boot$boot"
        say "REPORTED previous-boot-event=$reported"
    fi
    finish "after-boot-$boot"
fi

# Cluster mode: relate the guest's clock to the host's (the API double's
# request log) for the "trigger -> request received" latencies. Each probe
# opens a connection first, then sends one request that the double logs with
# its host time: that time lies between the guest's send and receive times
# ($EPOCHREALTIME: no fork in between). out/clock: "N SEND_US RECV_US".
clock_probes() {
    local i t0 t1 line
    for i in 1 2 3 4 5 6; do
        exec 3<>/dev/tcp/10.0.2.100/8099 || continue
        t0=$EPOCHREALTIME
        printf 'GET /version HTTP/1.1\r\nHost: 10.0.2.100\r\nUser-Agent: lastgasp-vm-clock/%s\r\nConnection: close\r\n\r\n' "$i" >&3
        read -r -t 10 line <&3
        t1=$EPOCHREALTIME
        exec 3<&-
        case "$line" in HTTP/*) echo "$i ${t0/./} ${t1/./}" >> "$OUT/clock" ;; esac
        sleep 0.2
    done
}
[ -f "$IN/lastgasp.env" ] && clock_probes

# A real node with AppArmor on (`vm-test --node --apparmor`): the agent's
# confinement, as the kernel has it.
if [ -f "$IN/node.env" ] && grep -q Y /sys/module/apparmor/parameters/enabled 2>/dev/null; then
    apid=$(pgrep -f "$AGENT_PATTERN" | head -1)
    label=$(cat "/proc/$apid/attr/apparmor/current" 2>/dev/null || cat "/proc/$apid/attr/current" 2>/dev/null)
    say "LSM apparmor=Y agent=${label// /_}"
fi
say "TRIGGER $SCENARIO"
trigger > "$OUT/trigger.out" 2>&1
rc=$?
say "TRIGGER-RETURNED rc=$rc"
# A shutdown scenario should never get past this sleep: the host's timeout
# ends it and reports it as not shut down. The others end here.
sleep "$WAIT"
say "STILL-UP after ${WAIT}s"
# Then what the scenario does once it has stayed up (drill-uninstall).
if declare -F after_still_up > /dev/null; then after_still_up >> "$OUT/trigger.out" 2>&1; fi
finish still-up
