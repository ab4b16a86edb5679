# root asks for a power-off while a block inhibitor is held, and asks
# systemctl to honour it (as an interactive root's systemctl does): logind
# refuses ("Access denied to root due to active block inhibitor"). No
# PrepareForShutdown, no job: the request must stay pending and drain nothing.
SCENARIO="systemctl poweroff held by a block inhibitor"
WAIT=10
trigger() {
    systemd-inhibit --what=shutdown --mode=block --who=test --why="hold" sleep 300 &
    sleep 1
    systemctl poweroff --check-inhibitors=yes
    echo "systemctl poweroff exited $? (refused: a block inhibitor)"
}
