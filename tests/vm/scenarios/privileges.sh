# Not a shutdown: which capability sets let the agent arm on this kernel.
# Each probe runs the agent as a transient unit with the same hardening as
# lastgasp.service but another capability set, waits until it arms or
# fails, stops it, and writes one PROBE line to out/privileges.txt. The
# guest stays up.
SCENARIO="capability probes (no shutdown)"
WAIT=5

probe() { # NAME CAPS [SYSCTL-PARANOID]
    local name=$1 caps=$2 paranoid=${3:-} err=/tmp/probe-$1.err old
    old=$(cat /proc/sys/kernel/perf_event_paranoid)
    [ -n "$paranoid" ] && echo "$paranoid" > /proc/sys/kernel/perf_event_paranoid
    rm -f "$err"
    timeout 30 systemd-run --quiet --unit="lastgasp-probe-$name" -p TimeoutStopSec=5 \
        -p CapabilityBoundingSet="$caps" -p AmbientCapabilities="$caps" -p NoNewPrivileges=yes \
        -p StandardError="file:$err" -p StandardOutput=null -p Environment=NO_COLOR=1 \
        /usr/local/sbin/lastgasp run --standalone --audit-dir "/tmp/probe-$name"
    local result=timeout
    sleep 1
    for _ in $(seq 1 300); do
        if grep -q 'lastgasp: armed' "$err" 2>/dev/null; then result=armed; break; fi
        # (not `systemctl is-active`: the running agent audits every systemctl exec)
        # (cgroup files have no size: test their content, not -s)
        if ! grep -q . "/sys/fs/cgroup/system.slice/lastgasp-probe-$name.service/cgroup.procs" 2>/dev/null; then
            result=refused; break
        fi
        sleep 0.1
    done
    timeout 20 systemctl status --no-pager -l "lastgasp-probe-$name" > "$OUT/probe-$name.status" 2>&1
    timeout 20 systemctl kill -s KILL "lastgasp-probe-$name" 2>/dev/null
    timeout 20 systemctl stop "lastgasp-probe-$name" 2>/dev/null
    timeout 20 systemctl reset-failed "lastgasp-probe-$name" 2>/dev/null
    echo "$old" > /proc/sys/kernel/perf_event_paranoid
    cp "$err" "$OUT/probe-$name.err" 2>/dev/null
    local why
    why=$(tr '\n' ' ' < "$err" | grep -o 'lastgasp needs[^;]*\|cannot work[^;]*\|Permission denied[^;]*' | head -1 | cut -c1-160)
    echo "PROBE $name caps=[$caps] perf_event_paranoid=${paranoid:-$old}: $result${why:+ ($why)}" >> "$OUT/privileges.txt"
}

trigger() {
    # One agent at a time: the unit's own instance is stopped first.
    systemctl stop lastgasp.service
    echo "kernel.perf_event_paranoid=$(cat /proc/sys/kernel/perf_event_paranoid)" > "$OUT/privileges.txt"
    probe minimal "CAP_BPF CAP_PERFMON CAP_SYS_PTRACE"
    probe with-sys-admin "CAP_BPF CAP_PERFMON CAP_SYS_PTRACE CAP_SYS_ADMIN"
    probe sys-admin-only "CAP_SYS_ADMIN CAP_SYS_PTRACE"
    probe minimal-paranoid2 "CAP_BPF CAP_PERFMON CAP_SYS_PTRACE" 2
}
