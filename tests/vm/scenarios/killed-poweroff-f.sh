# Maintenance: the kubelet stopped (its Lease goes silent), then root's
# `poweroff -f`, killed 2 s after its exec, before its reboot(2) (a
# preloaded library holds it first: tests/vm/node/hold.c). The node lives
# on: never fenced, the record with the direct tool's proof closed as failed.
SCENARIO="kubelet stopped; poweroff -f killed before its reboot(2)"
WAIT=40
trigger() {
    systemctl stop kubelet
    cp "$IN/node/hold.so" /run/lastgasp-hold.so
    LD_PRELOAD=/run/lastgasp-hold.so LASTGASP_HOLD_MS=60000 poweroff -f &
    tool=$!
    sleep 2
    kill -9 "$tool"
    wait "$tool"
    say "TOOL-ENDED rc=$?"
}
