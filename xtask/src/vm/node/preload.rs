//! The real node's root disk with its two images already in containerd's
//! store and the kubelet in place. `ctr images import` took 73-123 s of
//! every cell's boot under TCG; here one boot of its own imports them, powers
//! off, and every cell's root overlay is stacked on that disk. A cell then
//! checks that the disk holds this run's images (`images.sum`) and fails if
//! not: it never imports them behind the run's back.
use std::{
    fs,
    io::Write,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, ensure, Context, Result};

use super::{Prepared, MEM_MIB};
use crate::vm::qemu::{Exit, Guest, Spec};

/// The share's files a preload boot needs (the rest is the cells').
const FILES: &[&str] = &["node.sh", "node/containerd.toml", "node/tags"];
/// On the disk, not on a cell's share: the images, and the kubelet (77 MB
/// through 9p at every boot otherwise).
const IMAGES: &str = "node/images/";
const KUBELET: &str = "node/kubelet";
/// What the guest compares: one sum of the archives', the tags', the
/// kubelet's and the guest image's (`images_sum`), as the host saw them.
const SUM: &str = "node/images.sum";

/// Boots the guest once to import the images, unless a disk for the same
/// images and guest image is there from an earlier call; then every cell of
/// `p` boots from it, without the archives on its share.
pub fn preload(guest: &Guest, p: &mut Prepared, out: &Path) -> Result<()> {
    let sum = images_sum(guest, p)?;
    let dir = out.join(format!("preload-{}", &sum[..16]));
    let disk = dir.join("root.qcow2");
    let stamp = dir.join("preloaded");
    if fs::read_to_string(&stamp).is_ok_and(|s| s == sum) && disk.is_file() {
        println!(
            "vm-test: the node's images already preloaded in {}",
            disk.display()
        );
    } else {
        prune(out)?;
        let _ = fs::remove_dir_all(&dir);
        boot(guest, p, &dir, &sum)?;
        fs::write(&stamp, &sum)?;
    }
    p.files
        .retain(|(n, _)| !n.starts_with(IMAGES) && n != KUBELET);
    p.files.push((SUM.into(), sum.into_bytes()));
    p.preloaded = Some(disk);
    Ok(())
}

/// The images' archives and tags, the kubelet, and the guest image under
/// them (its key and mtime: a disk stacked on a base rebuilt in place would
/// be garbage).
fn images_sum(guest: &Guest, p: &Prepared) -> Result<String> {
    let base = fs::metadata(&guest.image.base)
        .with_context(|| format!("reading {}", guest.image.base.display()))?
        .modified()?
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let mut listed = format!("{} {base}\n", guest.image.key);
    for (name, data) in &p.files {
        if name.starts_with(IMAGES) || name == "node/tags" || name == KUBELET {
            listed.push_str(&format!("{} {name}\n", sha256(data)?));
        }
    }
    ensure!(
        listed.contains(IMAGES),
        "no image archives among the node's files"
    );
    sha256(listed.as_bytes())
}

fn sha256(data: &[u8]) -> Result<String> {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("running sha256sum")?;
    child
        .stdin
        .take()
        .context("sha256sum's stdin")?
        .write_all(data)?;
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "sha256sum failed");
    let hex = String::from_utf8_lossy(&out.stdout);
    let hex = hex.split_whitespace().next().unwrap_or_default();
    ensure!(hex.len() == 64, "sha256sum said {hex:?}");
    Ok(hex.to_string())
}

fn boot(guest: &Guest, p: &Prepared, dir: &Path, sum: &str) -> Result<()> {
    let started = std::time::Instant::now();
    let mut files: Vec<(String, Vec<u8>)> = p
        .files
        .iter()
        .filter(|(n, _)| FILES.contains(&n.as_str()) || n.starts_with(IMAGES) || n == KUBELET)
        .cloned()
        .collect();
    files.push((SUM.into(), sum.as_bytes().to_vec()));
    files.push(("node.env".into(), b"PRELOAD=1\n".to_vec()));
    let spec = Spec {
        scenario: "node-preload",
        dir: dir.to_path_buf(),
        allow_reset: false,
        boot_timeout: Duration::from_secs(240),
        timeout: Duration::from_secs(600),
        extra_in: files,
        // No route anywhere: the runner wants a NIC in node mode.
        nic: Some("user,restrict=on".into()),
        disks_from: None,
        keep_overlay: true,
        mem_mib: MEM_MIB,
        apparmor: false,
        arm_timeout: Duration::from_secs(420),
        base: None,
    };
    let run = guest.boot(&spec)?;
    let said = run.markers("PRELOADED").len() == 1;
    let fail: Vec<String> = run
        .markers("FAIL ")
        .iter()
        .map(|l| l.text.clone())
        .collect();
    match (&run.exit, said, fail.is_empty()) {
        (Exit::Exited(st), true, true) if st.success() => {
            println!(
                "vm-test: the node's images preloaded in {:.0} s ({})",
                started.elapsed().as_secs_f64(),
                dir.join("root.qcow2").display()
            );
            Ok(())
        }
        (exit, _, _) => bail!(
            "preloading the node's images failed ({exit:?}; {}; the console in {})",
            if fail.is_empty() {
                "no PRELOADED".to_string()
            } else {
                fail.join("; ")
            },
            dir.join("console.log").display()
        ),
    }
}

/// Earlier preloaded disks (other images): one is kept, the one being made.
fn prune(out: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(out) else {
        return Ok(());
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with("preload-") {
            fs::remove_dir_all(e.path())
                .with_context(|| format!("removing {}", e.path().display()))?;
        }
    }
    Ok(())
}
