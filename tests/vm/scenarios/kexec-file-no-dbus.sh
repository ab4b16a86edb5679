# A node as Talos runs it, seen by an agent told there is no systemd
# (--no-dbus): the next kernel loaded with kexec_file_load(2) (`kexec -s`),
# then `kexec -e`, which calls reboot(2) LINUX_REBOOT_CMD_KEXEC itself. No
# logind, no systemd job: only the kernel hooks can see it.
SCENARIO="kexec -s -l; kexec -e (agent --no-dbus)"
AGENT_ENV="LASTGASP_NO_DBUS=true"
trigger() {
    local k img
    k=$(uname -r)
    img=/boot/vmlinuz-$k
    # arm64's kexec_file_load takes only an uncompressed Image.
    if gzip -t "$img" 2>/dev/null; then
        zcat "$img" > /run/kexec-Image && img=/run/kexec-Image
    fi
    if ! kexec -s -l "$img" --initrd="/boot/initrd.img-$k" --reuse-cmdline; then
        # Debian's arm64 kernel has no CONFIG_KEXEC_FILE: kexec_load(2) then.
        echo "kexec_file_load refused: loading with kexec_load instead"
        kexec -l "/boot/vmlinuz-$k" --initrd="/boot/initrd.img-$k" --reuse-cmdline || return 1
    fi
    kexec -e
}
