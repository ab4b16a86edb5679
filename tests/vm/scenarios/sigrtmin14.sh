# SIGRTMIN+14 to PID 1: systemd powers off at once (like --force).
SCENARIO="kill -s SIGRTMIN+14 1"
trigger() { kill -s SIGRTMIN+14 1; }
