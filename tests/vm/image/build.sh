#!/bin/bash
# Builds the lastgasp VM guest: a Debian (bookworm) root file system made with
# debootstrap, a small initrd and the kernel, ready for `cargo xtask vm-test`.
#
#   build.sh OUTDIR SUITE MIRROR [ARCH]
#
# ARCH is amd64 (default) or arm64; arm64 runs its package scripts under
# qemu-user (binfmt_misc, registered by xtask).
#
# Writes OUTDIR/{base.img,vmlinux,vmlinuz,initrd.img,kernel-release,packages.lst}.
# xtask keys the cache on a hash of this script, packages.txt, rootfs/ and the
# suite, so any change here rebuilds the image; nothing else does. Runs as root
# on the host, writes only under OUTDIR.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=$1
suite=$2
mirror=$3
arch=${4:-amd64}

root=$out/rootfs
rm -rf "$root"
mkdir -p "$out"

pkgs=$(grep -v '^\s*#' "$here/packages.txt" | sed "s/^linux-image-amd64\$/linux-image-$arch/" | xargs | tr ' ' ,)
echo "vm-image: debootstrap $suite $arch (minbase + $pkgs)"
debootstrap --arch="$arch" --variant=minbase --include="$pkgs" "$suite" "$root" "$mirror" > "$out/debootstrap.log" 2>&1 || {
    tail -30 "$out/debootstrap.log"
    echo "vm-image: debootstrap failed (full log: $out/debootstrap.log)" >&2
    exit 1
}

# Files that shape the guest (units, fstab, masks).
cp -a "$here/rootfs/." "$root/"

echo lastgasp-guest > "$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 lastgasp-guest\n' > "$root/etc/hosts"
# No login anywhere: scenarios are scripted. A serial getty would also hang
# up the console.
chroot "$root" passwd -d root >/dev/null
for u in serial-getty@ttyS0.service serial-getty@ttyS1.service getty@tty1.service \
    apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer \
    e2scrub_reap.service fstrim.timer systemd-networkd.service systemd-networkd-wait-online.service \
    systemd-timesyncd.service systemd-resolved.service kexec-load.service kexec.service \
    systemd-pstore.service; do
    ln -sf /dev/null "$root/etc/systemd/system/$u"
done
if [ "$arch" = arm64 ]; then
    # `virt` has one UART (the console, ttyAMA0): the agent's stdout goes to
    # a virtio console, hvc0; neither gets a getty.
    for u in serial-getty@ttyAMA0.service serial-getty@hvc0.service; do
        ln -sf /dev/null "$root/etc/systemd/system/$u"
    done
    mkdir -p "$root/etc/systemd/system/lastgasp.service.d"
    printf '[Service]\nStandardOutput=file:/dev/hvc0\n' > "$root/etc/systemd/system/lastgasp.service.d/arm64.conf"
fi
# kexec-tools must not hijack reboots: the kexec scenario loads its kernel itself.
echo 'LOAD_KEXEC=false' > "$root/etc/default/kexec"
chroot "$root" systemctl enable lastgasp-vm.service >/dev/null 2>&1
# containerd only for the real node (`vm-test --node`), which starts it.
chroot "$root" systemctl disable containerd.service >/dev/null 2>&1 || true
mkdir -p "$root/mnt/lastgasp" "$root/var/lib/lastgasp"

# A small initrd: only what mounts an ext4 root on virtio-blk.
kver=$(basename "$(ls -d "$root"/lib/modules/* | sort -V | tail -1)")
conf=$root/etc/initramfs-tools-lastgasp
rm -rf "$conf"
cp -a "$root/etc/initramfs-tools" "$conf"
sed -i 's/^MODULES=.*/MODULES=list/; s/^COMPRESS=.*/COMPRESS=gzip/' "$conf/initramfs.conf"
printf '%s\n' virtio_pci virtio_blk crc32c_generic ext4 > "$conf/modules"
rm -f "$root"/boot/initrd.img-*
chroot "$root" mkinitramfs -d /etc/initramfs-tools-lastgasp -o "/boot/initrd.img-$kver" "$kver" 2>&1 \
    | grep -v 'W: .*firmware' || true
test -s "$root/boot/initrd.img-$kver"
rm -rf "$conf"

cp "$root/boot/vmlinuz-$kver" "$out/vmlinuz"
cp "$root/boot/initrd.img-$kver" "$out/initrd.img"
echo "$kver" > "$out/kernel-release"
cp "$root/boot/config-$kver" "$out/kernel-config"

# The uncompressed kernel boots straight through PVH (a few seconds sooner
# under TCG than the bzImage, which decompresses itself). Like the kernel's
# scripts/extract-vmlinux: find the payload's magic, decompress, check ELF.
extract() {
    local magic=$1 cmd=$2 pos
    for pos in $(LC_ALL=C grep -obUaP "$magic" "$out/vmlinuz" | cut -d: -f1 | head -5); do
        tail -c+$((pos + 1)) "$out/vmlinuz" | $cmd > "$out/vmlinux.tmp" 2>/dev/null || true
        if [ "$(head -c4 "$out/vmlinux.tmp" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then
            mv "$out/vmlinux.tmp" "$out/vmlinux"
            return 0
        fi
    done
    return 1
}
rm -f "$out/vmlinux"
if [ "$arch" = amd64 ]; then
    extract '\x28\xb5\x2f\xfd' 'zstd -dcq' || extract '\xfd\x37\x7a\x58\x5a\x00' 'xz -dcq --single-stream' \
        || extract '\x1f\x8b\x08' 'gzip -dcq' || echo "vm-image: no uncompressed vmlinux; the bzImage will be booted"
fi
rm -f "$out/vmlinux.tmp"

chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' > "$out/packages.lst"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/debconf/*-old "$root"/usr/share/doc/* "$root"/usr/share/man/*

echo "vm-image: mkfs.ext4 -d ($(du -sh "$root" | cut -f1))"
rm -f "$out/base.img"
mkfs.ext4 -q -F -L lastgasp-root -d "$root" "$out/base.img" 2G
rm -rf "$root"
echo "vm-image: done: kernel $kver, $(wc -l < "$out/packages.lst") packages"
