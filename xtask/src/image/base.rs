//! The image's runtime base: Debian's slim image from its registry (the
//! Containerfile's default), or, where no container registry is reachable
//! (this workplace's machines, CI), the same suite made here with
//! debootstrap, cached, and imported as a local image.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{ensure, Context, Result};

use super::DebPackage;
use crate::{arch::Arch, cmd::output, setup};

/// The suite of the Containerfile's `debian:bookworm-slim`.
const SUITE: &str = "bookworm";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Base {
    /// The Containerfile's `BASE`, pulled by podman.
    Registry,
    /// Debian `SUITE` made with debootstrap (minbase, without the docs,
    /// manuals and translations Debian's slim images leave out).
    Local,
}

impl Base {
    /// podman's arguments for an image of `arch`: none for the
    /// Containerfile's own base; else the runtime's base and the build
    /// stage's (linux/amd64), neither pulled.
    pub fn build_args(self, dir: &Path, arch: Arch) -> Result<Vec<String>> {
        Ok(match self {
            Base::Registry => Vec::new(),
            Base::Local => vec![
                "--pull=never".into(),
                "--build-arg".into(),
                format!("BASE={}", local(dir, arch)?),
                "--build-arg".into(),
                format!("BUILD_BASE={}", local(dir, Arch::Amd64)?),
            ],
        })
    }
}

fn local(dir: &Path, arch: Arch) -> Result<String> {
    let tag = format!("localhost/lastgasp-base:{SUITE}-{}", arch.name());
    let exists = super::podman(dir)
        .args(["image", "exists", &tag])
        .status()
        .context("podman image exists")?;
    if exists.success() {
        return Ok(tag);
    }
    let cache = setup::cache_dir().join("base");
    let tar = cache.join(format!("debian-{SUITE}-{}.tar", arch.name()));
    if !tar.is_file() {
        make(&cache, arch, &tar)?;
    }
    crate::run(
        super::podman(dir)
            .args(["import", "--quiet", "--arch", arch.name()])
            .args(["--change", r#"CMD ["/bin/bash"]"#])
            .arg(&tar)
            .arg(&tag),
    )
    .with_context(|| format!("podman import {}", tar.display()))?;
    println!("image: base {tag} imported from {}", tar.display());
    Ok(tag)
}

/// Debian's slim images leave these out (their dpkg configuration).
const SLIMMED: [&str; 6] = [
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
];

fn make(cache: &Path, arch: Arch, tar: &Path) -> Result<()> {
    setup::ensure_debs(&[("debootstrap", "debootstrap")])?;
    if arch != Arch::Amd64 {
        // debootstrap's second stage runs the arch's own programs.
        setup::ensure_arm64_emulation()?;
    }
    let root: PathBuf = cache.join(format!("{SUITE}-{}.d", arch.name()));
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(cache)?;
    println!(
        "image: making the base, Debian {SUITE} {} (debootstrap minbase from {}), cached as {}",
        arch.name(),
        setup::DEBIAN_MIRROR,
        tar.display()
    );
    let log = cache.join(format!("debootstrap-{}.log", arch.name()));
    let st = Command::new("debootstrap")
        .arg(format!("--arch={}", arch.name()))
        .args(["--variant=minbase", SUITE])
        .arg(&root)
        .arg(setup::DEBIAN_MIRROR)
        .stdout(fs::File::create(&log)?)
        .stderr(fs::File::create(&log)?.try_clone()?)
        .status()
        .context("running debootstrap")?;
    ensure!(
        st.success(),
        "debootstrap of the image's base failed ({st}); see {}",
        log.display()
    );
    for d in SLIMMED {
        let d = root.join(d);
        fs::remove_dir_all(&d).with_context(|| format!("slimming {}", d.display()))?;
        fs::create_dir_all(&d)?;
    }
    let tmp = tar.with_extension("tar.part");
    crate::run(
        Command::new("tar")
            .args(["--numeric-owner", "-C"])
            .arg(&root)
            .arg("-cf")
            .arg(&tmp)
            .arg("."),
    )
    .context("tar of the base")?;
    fs::rename(&tmp, tar)?;
    fs::remove_dir_all(&root)?;
    Ok(())
}

/// The Debian packages installed in image `tag` (its dpkg status), read
/// from the image mounted, whatever its arch.
pub fn packages(dir: &Path, tag: &str) -> Result<Vec<DebPackage>> {
    let at =
        output(super::podman(dir).args(["image", "mount", tag])).context("podman image mount")?;
    let status = fs::read_to_string(Path::new(at.trim()).join("var/lib/dpkg/status"));
    let _ = super::podman(dir).args(["image", "unmount", tag]).output();
    let status = status.with_context(|| format!("{tag} has no dpkg status"))?;
    let found = parse_status(&status);
    ensure!(!found.is_empty(), "{tag}'s dpkg status names no package");
    Ok(found)
}

/// The installed packages of a dpkg status file.
fn parse_status(status: &str) -> Vec<DebPackage> {
    status
        .split("\n\n")
        .filter_map(|block| {
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
            };
            (field("Status")? == "install ok installed").then(|| DebPackage {
                name: field("Package").unwrap_or_default().into(),
                version: field("Version").unwrap_or_default().into(),
                arch: field("Architecture").unwrap_or_default().into(),
            })
        })
        .filter(|p| !p.name.is_empty() && !p.version.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_installed_packages_are_the_base() {
        let status = "Package: libc6\nStatus: install ok installed\nArchitecture: arm64\nVersion: 2.36-9+deb12u10\n\n\
                      Package: gone\nStatus: deinstall ok config-files\nArchitecture: amd64\nVersion: 1\n\n\
                      Package: base-files\nStatus: install ok installed\nArchitecture: amd64\nVersion: 12.4+deb12u11\n";
        let got = parse_status(status);
        assert_eq!(
            got,
            vec![
                DebPackage {
                    name: "libc6".into(),
                    version: "2.36-9+deb12u10".into(),
                    arch: "arm64".into()
                },
                DebPackage {
                    name: "base-files".into(),
                    version: "12.4+deb12u11".into(),
                    arch: "amd64".into()
                },
            ]
        );
    }
}
