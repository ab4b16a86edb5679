# halt -f: systemd's halt(8) counts one -f as two: it calls reboot(2) itself
# (no manager), and the CPUs stop; the machine stays on (qemu keeps running).
SCENARIO="halt -f"
trigger() { halt -f; }
