# Root's `poweroff -f` held 12 s before its own code runs (a preloaded
# library: tests/vm/node/hold.c), past the agent's bound on a direct
# tool's proof (trust.directToolWithin, 5 s): the proof is withdrawn, the
# record closed as failed; then its reboot(2) powers the node off, and
# only the kernel's own proof can fence it.
SCENARIO="poweroff -f held 12 s before its reboot(2)"
trigger() {
    # Not /run: it is noexec, and the loader would skip the library.
    install -m 0755 "$IN/node/hold.so" /usr/local/lib/lastgasp-hold.so
    if LD_PRELOAD=/usr/local/lib/lastgasp-hold.so LASTGASP_HOLD_MS=1 /bin/true 2>&1 | grep -q .; then
        say "FAIL the hold library does not preload"
        return 1
    fi
    LD_PRELOAD=/usr/local/lib/lastgasp-hold.so LASTGASP_HOLD_MS=12000 poweroff -f
}
