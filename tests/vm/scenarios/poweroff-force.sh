# --force: PID 1 skips the service stop jobs and goes to systemd-shutdown.
SCENARIO="systemctl poweroff --force"
trigger() { systemctl poweroff --force; }
