# The README's drill, then an uninstall, in one boot (CI's budget): the
# drill (scenario drill) must move nothing before STILL-UP; then the
# DaemonSet is deleted (scenario uninstall, node_uninstall in node.sh).
SCENARIO="shutdown -h +10; shutdown -c; then the DaemonSet deleted"
WAIT=15
trigger() { shutdown -h +10 && sleep 15 && shutdown -c; }
after_still_up() { node_uninstall; }
