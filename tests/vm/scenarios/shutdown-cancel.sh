# Scheduled, then cancelled: the guest must stay up.
SCENARIO="shutdown -h +5; shutdown -c"
WAIT=10
trigger() { shutdown -h +5 && sleep 3 && shutdown -c; }
