# A power cut: on the runner's POWER-CUT marker the host quits qemu (QMP
# `quit`): no shutdown of any kind reaches the guest, its page cache is
# lost. The node is then switched on again (same disks): its agent must say
# the previous boot ended unannounced, and the controller's ledger keep one
# `unannounced` entry for that boot. Nothing may fence it: no proof exists.
SCENARIO="the power cut (qemu quit by the host), then switched on again"
WAIT=60
trigger() { say "POWER-CUT"; }
