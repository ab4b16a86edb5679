# Maintenance: the kubelet stopped (its Lease goes silent), then root's
# `poweroff -f`, killed 2 s after its exec, before its reboot(2) (a
# preloaded library holds it first: tests/vm/node/hold.c). The node lives
# on: never fenced, the record with the direct tool's proof closed as failed.
SCENARIO="kubelet stopped; poweroff -f killed before its reboot(2)"
WAIT=40
trigger() {
    systemctl stop kubelet
    # Not /run: it is noexec, and the loader would skip the library.
    install -m 0755 "$IN/node/hold.so" /usr/local/lib/lastgasp-hold.so
    if LD_PRELOAD=/usr/local/lib/lastgasp-hold.so LASTGASP_HOLD_MS=1 /bin/true 2>&1 | grep -q .; then
        say "FAIL the hold library does not preload"
        return 1
    fi
    LD_PRELOAD=/usr/local/lib/lastgasp-hold.so LASTGASP_HOLD_MS=60000 poweroff -f &
    tool=$!
    sleep 2
    kill -9 "$tool"
    wait "$tool"
    say "TOOL-ENDED rc=$?"
}
