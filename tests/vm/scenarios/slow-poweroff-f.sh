# Root's `poweroff -f` held 12 s before its own code runs (a preloaded
# library: tests/vm/node/hold.c), past the agent's bound on a direct
# tool's proof (trust.directToolWithin, 5 s): the proof is withdrawn, the
# record closed as failed; then its reboot(2) powers the node off, and
# only the kernel's own proof can fence it.
SCENARIO="poweroff -f held 12 s before its reboot(2)"
trigger() {
    cp "$IN/node/hold.so" /run/lastgasp-hold.so
    LD_PRELOAD=/run/lastgasp-hold.so LASTGASP_HOLD_MS=12000 poweroff -f
}
