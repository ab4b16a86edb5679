# systemctl soft-reboot needs systemd >= 254; the guest has 252, which
# refuses the verb. The attempt is still seen; the guest must stay up.
SCENARIO="systemctl soft-reboot"
WAIT=10
trigger() { systemctl soft-reboot; }
