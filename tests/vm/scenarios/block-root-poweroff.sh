# root (no tty: systemctl does not check inhibitors itself) asks for a
# power-off while root holds a `block` inhibitor. systemd before 257 lets
# the caller pass its own uid's block lock: the node powers off, gracefully.
# systemd 257 applies `block` to root too: logind refuses, nothing may drain.
SCENARIO="systemctl poweroff under root's block inhibitor"
WAIT=30
trigger() {
    systemd-inhibit --what=shutdown --mode=block --who=test --why="hold" sleep 300 &
    sleep 1
    systemctl poweroff
    echo "systemctl poweroff exited $?"
}
