# Root's `poweroff -f` confined by an AppArmor profile that denies
# CAP_SYS_BOOT: its reboot(2) enters the kernel (the kernel's proof goes
# out) and is refused there, at the capability check, while a flood of
# lent-privilege execs runs (uid 65534 running a setuid-root copy of true
# under the name poweroff). The node lives on: the proof must be taken
# back before the controller's quiet time (--proof-quiet), and the record
# closed as failed. Needs `vm-test --node --apparmor ...`.
SCENARIO="poweroff -f refused by AppArmor (deny capability sys_boot), under a flood"
WAIT=30
trigger() {
    cat > /etc/apparmor.d/lastgasp-no-boot <<'PROFILE'
abi <abi/3.0>,
profile lastgasp-no-boot {
  capability,
  deny capability sys_boot,
  file,
  network,
  signal,
  ptrace,
  unix,
  dbus,
  mount,
  umount,
  pivot_root,
  change_profile,
}
PROFILE
    apparmor_parser -r /etc/apparmor.d/lastgasp-no-boot || { say "FAIL apparmor_parser"; return 1; }
    install -m 4755 /bin/true /var/tmp/lastgasp-notatool
    ln -sf /var/tmp/lastgasp-notatool /var/tmp/poweroff
    (
        end=$((SECONDS + 20))
        while [ "$SECONDS" -lt "$end" ]; do
            setpriv --reuid=65534 --regid=65534 --clear-groups /var/tmp/poweroff -f
        done
    ) &
    flood=$!
    sleep 3
    say "REFUSED-TOOL start"
    aa-exec -p lastgasp-no-boot -- poweroff -f
    say "TOOL-ENDED rc=$?"
    wait "$flood"
}
