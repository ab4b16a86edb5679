# The README's safe drill: a power-off scheduled ten minutes out, then
# cancelled. The node must say so (condition, Events) and nothing move.
SCENARIO="shutdown -h +10; shutdown -c"
WAIT=15
trigger() { shutdown -h +10 && sleep 15 && shutdown -c; }
