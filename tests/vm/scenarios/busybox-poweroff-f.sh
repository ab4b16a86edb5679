# busybox poweroff -f: busybox calls reboot(2) POWER_OFF itself, in the
# node's own PID namespace (no manager, no logind).
SCENARIO="busybox poweroff -f"
trigger() { busybox poweroff -f; }
