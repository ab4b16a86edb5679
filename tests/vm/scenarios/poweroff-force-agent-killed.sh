# --force, and the agent SIGKILLed once PID 1 is systemd-shutdown: what
# containerd's clean-up of a shim that died in the final sweep does to it
# (`runc delete --force`; seen in about one forced power-off in three). Its
# courier must then send the last word from systemd-shutdown's hook.
# Builtins only in the killer: a forked child would die in the sweep.
SCENARIO="systemctl poweroff --force, the agent SIGKILLed in systemd-shutdown"
trigger() {
    local agent
    agent=$(pgrep -f '^@lastgasp .*run' | head -1)
    [ -n "$agent" ] || { echo "no agent to kill"; return 1; }
    mkfifo /run/lastgasp-vm-killer.fifo 2>/dev/null
    # shellcheck disable=SC2016
    (exec -a @lastgasp-vm-killer bash -c '
        exec 3<>/run/lastgasp-vm-killer.fifo
        c=
        while [ "$c" != systemd-shutdow ]; do read -r c < /proc/1/comm; read -r -t 0.02 -u 3 _; done
        read -r -t 0.5 -u 3 _
        kill -9 "$0" && echo "lastgasp-vm: 0 KILLED agent $0" > /dev/kmsg' "$agent") &
    systemctl poweroff --force
}
