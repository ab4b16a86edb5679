//! The guest image: Debian (the host's release, so the agent's glibc
//! matches) built by `tests/vm/image/build.sh` with debootstrap, cached under
//! `~/.cache/lastgasp/vm/image-KEY`, where KEY hashes everything that shapes
//! it: the script, the package list, the files copied in, the suite. Runs
//! use qcow2 overlays, so the cached base image is never written.
use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::qemu::wait_timeout;

/// Debian release of the guest: the host's (bookworm), for the agent's glibc.
pub const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";
/// A cold build is about 3 minutes on an idle 2-core machine.
const BUILD_TIMEOUT: Duration = Duration::from_secs(40 * 60);

pub struct Image {
    pub dir: PathBuf,
    pub base: PathBuf,
    /// vmlinux (booted through PVH) when it could be extracted, else the bzImage.
    pub kernel: PathBuf,
    pub pvh: bool,
    pub initrd: PathBuf,
    pub kernel_release: String,
    pub key: String,
    /// Set when this call built it.
    pub built_in: Option<Duration>,
}

pub fn ensure(root: &Path) -> Result<Image> {
    let inputs = root.join("tests/vm/image");
    let key = input_key(&inputs)?;
    let cache = super::cache_dir();
    let dir = cache.join(format!("image-{key}"));
    let mut built_in = None;
    if !dir.join("complete").exists() {
        fs::create_dir_all(&cache)?;
        // Older images (other inputs) are dead weight: about 1 GB each.
        for e in fs::read_dir(&cache)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("image-") && e.path() != dir {
                let _ = fs::remove_dir_all(e.path());
            }
        }
        let tmp = cache.join(format!("image-{key}.tmp"));
        let _ = fs::remove_dir_all(&tmp);
        let _ = fs::remove_dir_all(&dir);
        let mirror = std::env::var("LASTGASP_VM_MIRROR").unwrap_or_else(|_| MIRROR.into());
        println!("vm-test: building the guest image ({SUITE}, key {key}); a few minutes, once");
        let t = Instant::now();
        let mut cmd = Command::new("bash");
        cmd.arg(inputs.join("build.sh"))
            .arg(&tmp)
            .arg(SUITE)
            .arg(&mirror)
            .stdin(Stdio::null());
        let mut child = cmd.spawn().context("starting tests/vm/image/build.sh")?;
        match wait_timeout(&mut child, BUILD_TIMEOUT)? {
            Some(st) if st.success() => {}
            Some(st) => bail!(
                "building the guest image failed ({st}); see the output above and {}/debootstrap.log",
                tmp.display()
            ),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "building the guest image took more than {} min: killed",
                    BUILD_TIMEOUT.as_secs() / 60
                );
            }
        }
        fs::write(
            tmp.join("inputs"),
            format!("suite {SUITE}\nmirror {mirror}\nkey {key}\n"),
        )?;
        fs::rename(&tmp, &dir)?;
        fs::write(dir.join("complete"), "")?;
        built_in = Some(t.elapsed());
        println!(
            "vm-test: guest image built in {:.0} s",
            t.elapsed().as_secs_f64()
        );
    }
    let vmlinux = dir.join("vmlinux");
    let pvh = vmlinux.is_file() && std::env::var_os("LASTGASP_VM_BZIMAGE").is_none();
    Ok(Image {
        base: dir.join("base.img"),
        kernel: if pvh { vmlinux } else { dir.join("vmlinuz") },
        pvh,
        initrd: dir.join("initrd.img"),
        kernel_release: fs::read_to_string(dir.join("kernel-release"))
            .unwrap_or_default()
            .trim()
            .to_string(),
        key,
        built_in,
        dir,
    })
}

/// sha256 over the image's inputs (relative path and contents of every file
/// under `tests/vm/image`, in order) and the suite; the first 16 hex digits.
fn input_key(inputs: &Path) -> Result<String> {
    let mut files = Vec::new();
    walk(inputs, &mut files)?;
    files.sort();
    let mut data = format!("suite={SUITE}\0").into_bytes();
    for f in files {
        let rel = f.strip_prefix(inputs).unwrap_or(&f);
        data.extend_from_slice(rel.to_string_lossy().as_bytes());
        data.push(0);
        data.extend_from_slice(&fs::read(&f).with_context(|| format!("reading {}", f.display()))?);
        data.push(0);
    }
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("running sha256sum")?;
    child.stdin.take().unwrap().write_all(&data)?;
    let out = child.wait_with_output()?;
    let hex = String::from_utf8_lossy(&out.stdout);
    let key: String = hex.chars().take(16).collect();
    if key.len() != 16 {
        bail!("sha256sum gave no digest");
    }
    Ok(key)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            walk(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}
