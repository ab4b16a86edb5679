# An unprivileged user forces a reboot: `reboot -ff` (systemctl refuses
# without root), then busybox's, whose reboot(2) fails with EPERM. Neither
# caller holds CAP_SYS_BOOT: audit only, nothing written to the cluster.
SCENARIO="reboot -ff and busybox reboot -f as nobody (EPERM)"
WAIT=10
trigger() {
    setpriv --reuid=nobody --regid=nogroup --clear-groups reboot -ff
    echo "reboot -ff as nobody exited $?"
    setpriv --reuid=nobody --regid=nogroup --clear-groups busybox reboot -f
    echo "busybox reboot -f as nobody exited $?"
}
