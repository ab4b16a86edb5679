# Maintenance: the kubelet stopped (its Lease goes silent), then root's
# `poweroff -f`, whose reboot(2) a seccomp filter refuses before the kernel
# sees it (systemd's SystemCallFilter). The node lives on: never fenced,
# the record with the direct tool's proof closed as failed.
SCENARIO="kubelet stopped; poweroff -f, its reboot(2) refused by seccomp"
WAIT=40
trigger() {
    systemctl stop kubelet
    systemd-run --wait --pipe --quiet -p SystemCallFilter=~reboot -p SystemCallErrorNumber=EPERM poweroff -f
    say "TOOL-ENDED rc=$?"
}
