# The ordinary graceful path: systemctl asks logind, PID 1 stops every
# service, then execs systemd-shutdown, which calls reboot(2).
SCENARIO="systemctl poweroff"
trigger() { systemctl poweroff; }
