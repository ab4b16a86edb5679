# A node as Talos runs it, seen by an agent told there is no systemd
# (--no-dbus): the next kernel loaded with kexec_file_load(2) (`kexec -s`),
# then `kexec -e`, which calls reboot(2) LINUX_REBOOT_CMD_KEXEC itself. No
# logind, no systemd job: only the kernel hooks can see it.
SCENARIO="kexec -s -l; kexec -e (agent --no-dbus)"
AGENT_ENV="LASTGASP_NO_DBUS=1"
trigger() {
    local k
    k=$(uname -r)
    kexec -s -l "/boot/vmlinuz-$k" --initrd="/boot/initrd.img-$k" --reuse-cmdline || return 1
    kexec -e
}
