# Graceful reboot; the next boot reports the previous one's shutdown.
SCENARIO="systemctl reboot"
trigger() { systemctl reboot; }
