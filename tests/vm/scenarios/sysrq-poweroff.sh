# A power-off the kernel starts by itself (magic SysRq 'o'): no tool is
# executed, no reboot(2) is called; only the kernel hooks can see it.
SCENARIO="echo o > /proc/sysrq-trigger"
trigger() { echo o > /proc/sysrq-trigger; }
