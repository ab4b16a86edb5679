# reboot -ff: systemctl itself calls reboot(2) RESTART; PID 1 is not asked.
# The kernel resets the machine as soon as the call is made.
SCENARIO="reboot -ff"
trigger() { reboot -ff; }
