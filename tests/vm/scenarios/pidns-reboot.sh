# reboot(2) with valid magic from PID 1 of its own PID namespace (what a
# container's `poweroff -f` does): the kernel ends only that namespace. The
# node must stay up, and the detection must say scope: container.
SCENARIO="poweroff -f as PID 1 of a new PID namespace"
WAIT=10
trigger() {
    unshare --pid --fork --mount-proc busybox poweroff -f
    echo "unshare exited $? (128+2 = SIGINT: the namespace's init was killed by its reboot(2))"
}
