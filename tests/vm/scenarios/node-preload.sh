# Not a scenario: the real node's image preload (`vm::node::preload`). The
# runner imports the images and powers the guest off before any trigger.
SCENARIO="none: the node's images imported, then a power-off"
trigger() { return 0; }
