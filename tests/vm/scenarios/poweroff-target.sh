# Starting the target directly: no logind, no systemctl verb to decode.
SCENARIO="systemctl start poweroff.target"
trigger() { systemctl start poweroff.target; }
