# An uninstall: the agent's DaemonSet deleted (as `helm uninstall` and
# `kubectl delete -k` do), with a token allowed only that. The agent,
# stopped by it, must leave the host as node.sh listed it before the
# install (host_listing), and take its conditions off its Node.
SCENARIO="the agent's DaemonSet deleted (an uninstall)"
WAIT=5
trigger() { node_uninstall; }
