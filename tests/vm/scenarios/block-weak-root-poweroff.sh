# systemd 257's `block-weak` inhibitor is the old `block`: root (no tty)
# passes its own uid's lock, and the node powers off, gracefully.
SCENARIO="systemctl poweroff under root's block-weak inhibitor (systemd 257)"
WAIT=30
trigger() {
    systemd-inhibit --what=shutdown --mode=block-weak --who=test --why="hold" sleep 300 &
    sleep 1
    systemctl poweroff
    echo "systemctl poweroff exited $?"
}
