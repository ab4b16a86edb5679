# Not a shutdown: the release image of this guest's arch (the host put it
# on the share as image.oci.tar), run by containerd as the DaemonSet runs
# it (its four capabilities, the host's PID namespace and network, BTF
# read-only, tracefs), must arm. One IMAGE-ARMED line says so. The guest
# stays up.
SCENARIO="the release image under containerd (ctr) arms (no shutdown)"
WAIT=5
trigger() {
    local ref log=/run/image-arms.log armed=
    systemctl start containerd || { say "FAIL containerd did not start"; return 1; }
    ctr -n lastgasp images import "$IN/image.oci.tar" || { say "FAIL ctr import image.oci.tar"; return 1; }
    ref=$(ctr -n lastgasp images ls -q | grep lastgasp | head -1)
    echo "image: $ref ($(uname -m))"
    mkdir -p /run/image-audit
    ctr -n lastgasp run --rm --net-host --with-ns pid:/proc/1/ns/pid \
        --cap-add CAP_BPF --cap-add CAP_PERFMON --cap-add CAP_SYS_ADMIN --cap-add CAP_SYS_PTRACE \
        --mount type=bind,src=/sys/kernel/btf,dst=/sys/kernel/btf,options=rbind:ro \
        --mount type=bind,src=/sys/kernel/tracing,dst=/sys/kernel/tracing,options=rbind:rw \
        --mount type=bind,src=/run/image-audit,dst=/var/lib/lastgasp,options=rbind:rw \
        "$ref" image-arms /usr/local/bin/lastgasp --json-logs run --standalone --no-dbus \
        --metrics-listen off > "$log" 2>&1 &
    for _ in $(seq 1 1200); do
        if grep -q '"message":"armed"' "$log"; then armed=1; break; fi
        sleep 0.1
    done
    cat "$log"
    ctr -n lastgasp tasks kill -s KILL image-arms 2>/dev/null
    if [ -n "$armed" ]; then
        say "IMAGE-ARMED $ref $(uname -m)"
    else
        say "FAIL the image $ref did not arm within 120 s (out/trigger.out)"
        return 1
    fi
}
