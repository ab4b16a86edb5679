# A graceful shutdown of a node that has pods in several priority classes
# (tests/vm/cluster/objects.json in the API double). Needs cluster mode.
SCENARIO="systemctl poweroff, pods in 4 priority classes"
trigger() { systemctl poweroff; }
