//! The guest image: Debian, bookworm by default (the host's release, so the
//! agent's glibc matches) or another release (`--distro`: another kernel and
//! systemd), built by `tests/vm/image/build.sh` with debootstrap, cached
//! under `~/.cache/lastgasp/vm/image-[SUITE-]KEY`, where KEY hashes
//! everything that shapes it: the script, the package list, the files
//! copied in, the suite. One image per suite is kept. Runs use qcow2
//! overlays, so the cached base image is never written.
use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::wait_timeout;
use crate::arch::Arch;

/// The guest's Debian release: its kernel and systemd (`--distro`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Distro {
    /// Debian 11: kernel 5.10, systemd 247.
    Bullseye,
    /// Debian 12 (the host's): kernel 6.1, systemd 252.
    #[default]
    Bookworm,
    /// Debian 13: kernel 6.12, systemd 257.
    Trixie,
}

impl Distro {
    pub fn suite(self) -> &'static str {
        match self {
            Distro::Bullseye => "bullseye",
            Distro::Bookworm => "bookworm",
            Distro::Trixie => "trixie",
        }
    }

    /// The host's glibc (bookworm's 2.36) is newer than the guest's: the
    /// agent runs there with the host's loader and libraries beside it.
    pub fn needs_host_libc(self) -> bool {
        self == Distro::Bullseye
    }

    /// The cache directory's name: amd64 bookworm's keeps the name it
    /// always had; another arch's is prefixed by it.
    fn dir_name(self, arch: Arch, key: &str) -> String {
        let arch = match arch {
            Arch::Amd64 => String::new(),
            a => format!("{}-", a.name()),
        };
        match (self, arch.is_empty()) {
            (Distro::Bookworm, true) => format!("image-{key}"),
            (d, _) => format!("image-{arch}{}-{key}", d.suite()),
        }
    }

    /// Whether a cache entry is an image of this distro and arch (any key).
    fn owns(self, arch: Arch, name: &str) -> bool {
        let Some(rest) = name.strip_prefix("image-") else {
            return false;
        };
        if arch != Arch::Amd64 {
            return rest.starts_with(&format!("{}-{}-", arch.name(), self.suite()));
        }
        match self {
            Distro::Bookworm => !["bullseye-", "trixie-", "arm64-"]
                .iter()
                .any(|p| rest.starts_with(p)),
            d => rest.starts_with(&format!("{}-", d.suite())),
        }
    }
}
const MIRROR: &str = crate::setup::DEBIAN_MIRROR;
/// A cold build is about 3 minutes on an idle 2-core machine.
const BUILD_TIMEOUT: Duration = Duration::from_secs(40 * 60);

pub struct GuestImage {
    pub distro: Distro,
    pub arch: Arch,
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

/// Runs tests/vm/image/build.sh into `tmp` (bounded by `BUILD_TIMEOUT`)
/// and notes its inputs there.
fn build(inputs: &Path, tmp: &Path, suite: &str, arch: Arch, key: &str) -> Result<()> {
    let mirror = std::env::var("LASTGASP_VM_MIRROR").unwrap_or_else(|_| MIRROR.into());
    println!(
        "vm-test: building the guest image ({suite}, {}, key {key}); a few minutes, once",
        arch.name()
    );
    let mut cmd = Command::new("bash");
    cmd.arg(inputs.join("build.sh"))
        .arg(tmp)
        .arg(suite)
        .arg(&mirror)
        .arg(arch.name())
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
        format!(
            "suite {suite}\narch {}\nmirror {mirror}\nkey {key}\n",
            arch.name()
        ),
    )?;
    Ok(())
}

pub fn ensure(root: &Path, distro: Distro, arch: Arch) -> Result<GuestImage> {
    let suite = distro.suite();
    let inputs = root.join("tests/vm/image");
    // amd64's keys are what they were before arm64.
    let key = match arch {
        Arch::Amd64 => input_key(&inputs, suite)?,
        a => input_key(&inputs, &format!("{suite}/{}", a.name()))?,
    };
    let cache = super::cache_dir();
    let dir = cache.join(distro.dir_name(arch, &key));
    let mut built_in = None;
    if !dir.join("complete").exists() {
        fs::create_dir_all(&cache)?;
        // This distro's older images (other inputs) are dead weight: about
        // 1 GB each. Other distros' are kept.
        for e in fs::read_dir(&cache)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if distro.owns(arch, &name) && e.path() != dir {
                let _ = fs::remove_dir_all(e.path());
            }
        }
        let tmp = cache.join(format!("{}.tmp", distro.dir_name(arch, &key)));
        if arch == Arch::Arm64 {
            // debootstrap's second stage and the chroot steps run arm64 programs.
            crate::setup::ensure_arm64_emulation()?;
        }
        let _ = fs::remove_dir_all(&tmp);
        let _ = fs::remove_dir_all(&dir);
        let t = Instant::now();
        build(&inputs, &tmp, suite, arch, &key)?;
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
    Ok(GuestImage {
        distro,
        arch,
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
fn input_key(inputs: &Path, suite: &str) -> Result<String> {
    let mut files = Vec::new();
    walk(inputs, &mut files)?;
    files.sort();
    let mut data = format!("suite={suite}\0").into_bytes();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each (distro, arch) cleans only its own older images: an amd64
    /// bookworm rebuild must not delete the arm64 or other releases' images.
    #[test]
    fn each_image_owns_only_its_distro_and_arch() {
        let names = [
            Distro::Bookworm.dir_name(Arch::Amd64, "k1"),
            Distro::Trixie.dir_name(Arch::Amd64, "k2"),
            Distro::Bullseye.dir_name(Arch::Amd64, "k3"),
            Distro::Bookworm.dir_name(Arch::Arm64, "k4"),
            Distro::Trixie.dir_name(Arch::Arm64, "k5"),
        ];
        assert_eq!(names[0], "image-k1", "amd64 bookworm keeps its old name");
        assert_eq!(names[3], "image-arm64-bookworm-k4");
        let cells = [
            (Distro::Bookworm, Arch::Amd64),
            (Distro::Trixie, Arch::Amd64),
            (Distro::Bullseye, Arch::Amd64),
            (Distro::Bookworm, Arch::Arm64),
            (Distro::Trixie, Arch::Arm64),
        ];
        for (i, (d, a)) in cells.iter().enumerate() {
            for (j, n) in names.iter().enumerate() {
                assert_eq!(d.owns(*a, n), i == j, "{d:?}/{a:?} owns {n}?");
            }
        }
    }
}
