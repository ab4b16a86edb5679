# SIGRTMIN+4 to PID 1: systemd starts poweroff.target (graceful).
SCENARIO="kill -s SIGRTMIN+4 1"
trigger() { kill -s SIGRTMIN+4 1; }
