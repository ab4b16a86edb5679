# An unprivileged user asks for a power-off: logind refuses it (no polkit
# rule lets nobody power off), the node stays up, and the request must stay a
# request: pending, never confirmed, nothing written to the cluster.
SCENARIO="systemctl poweroff as nobody (refused)"
WAIT=10
trigger() {
    setpriv --reuid=nobody --regid=nogroup --clear-groups systemctl poweroff
    echo "systemctl poweroff as nobody exited $?"
}
