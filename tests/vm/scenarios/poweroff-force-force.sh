# --force --force: systemctl itself calls reboot(2); PID 1 is not asked.
SCENARIO="systemctl poweroff --force --force"
trigger() { systemctl poweroff --force --force; }
