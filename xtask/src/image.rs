//! `cargo xtask image`: the DaemonSet's image, from the release binary, with
//! no base image to pull: `FROM scratch` over a root filesystem the project
//! makes (the binary, stripped, and the few glibc libraries `ldd` names).
//! Built with Debian's podman, saved as an OCI archive under
//! `target/image/`, and checked by running it the way the DaemonSet does
//! (the same capabilities, host PID and network, read-only BTF, the host's
//! tracefs): it must arm.
use std::{
    fs,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use crate::{arch::Arch, setup};

/// The DaemonSet's added capabilities (deploy/kustomize/agent-daemonset.yaml;
/// tests/manifests/privileges.rs checks that list against the docs).
const CAPS: &str = "BPF,PERFMON,SYS_ADMIN,SYS_PTRACE";

pub struct Image {
    pub tag: String,
    pub arch: Arch,
    /// Where `build` saved it (an OCI archive).
    pub archive: PathBuf,
    /// The Debian packages its libraries were copied from (the SBOM's base).
    pub packages: Vec<DebPackage>,
}

/// A Debian package on the build host: name, version, architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct DebPackage {
    pub name: String,
    pub version: String,
    pub arch: String,
}

/// The package that installed `file` on this host (`dpkg -S`), with its version.
fn owner(file: &Path) -> Result<DebPackage> {
    let real = fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
    // dpkg knows a path as its package shipped it: /lib or /usr/lib.
    let candidates = [
        real.clone(),
        file.to_path_buf(),
        Path::new("/usr").join(real.strip_prefix("/").unwrap_or(&real)),
        real.strip_prefix("/usr")
            .map_or(real.clone(), |p| Path::new("/").join(p)),
    ];
    for c in &candidates {
        let out = Command::new("dpkg")
            .arg("-S")
            .arg(c)
            .output()
            .context("running dpkg -S")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(pkg) = text.lines().next().and_then(|l| l.split(": ").next()) else {
            continue;
        };
        if !out.status.success() {
            continue;
        }
        let pkg = pkg.split(", ").next().unwrap_or(pkg).to_string();
        let q = Command::new("dpkg-query")
            .args(["-W", "-f", "${Package}\t${Version}\t${Architecture}", &pkg])
            .output()
            .context("running dpkg-query")?;
        let line = String::from_utf8_lossy(&q.stdout).to_string();
        let f: Vec<&str> = line.split('\t').collect();
        ensure!(
            q.status.success() && f.len() == 3,
            "dpkg-query {pkg}: {line}"
        );
        return Ok(DebPackage {
            name: f[0].into(),
            version: f[1].into(),
            arch: f[2].into(),
        });
    }
    bail!(
        "no Debian package owns {} (dpkg -S): the SBOM cannot name the image's base",
        file.display()
    )
}

/// Podman set up for this machine: vfs storage (no overlay mounts needed),
/// runc (crun refuses this kernel's hybrid cgroups), and no default ulimits
/// (setting RLIMIT_NOFILE/NPROC needs CAP_SYS_RESOURCE, which a sandbox may
/// lack).
fn podman(dir: &Path) -> Command {
    let mut cmd = Command::new("podman");
    cmd.env("CONTAINERS_CONF", dir.join("containers.conf"))
        .args(["--storage-driver", "vfs", "--runtime", "runc"]);
    cmd
}

/// The image of `bin`, an agent built for `arch` (`build::build_for`).
pub fn build(target: &Path, bin: &Path, arch: Arch, version: &str) -> Result<Image> {
    setup::ensure_debs(&[
        ("podman", "podman"),
        ("runc", "runc"),
        ("strip", "binutils"),
    ])?;
    setup::ensure_cross(arch)?;
    let dir = target.join("image");
    let (tag, archive) = names(target, arch, version);
    let rootfs = dir.join("rootfs");
    let _ = fs::remove_dir_all(&rootfs);
    fs::create_dir_all(rootfs.join("usr/local/bin"))?;
    for d in [
        "tmp",
        "proc",
        "sys",
        "var/lib/lastgasp",
        "etc/lastgasp",
        "host",
    ] {
        fs::create_dir_all(rootfs.join(d))?;
    }
    // As on any distribution: the D-Bus system bus is found at
    // /var/run/dbus/system_bus_socket (zbus's default, the spec's), and the
    // DaemonSet mounts the host's /run/dbus at /run/dbus. Without the link
    // the agent in its pod never reached logind: no delay lock, no
    // PrepareForShutdown (found by `vm-test --node`).
    fs::create_dir_all(rootfs.join("run"))?;
    fs::create_dir_all(rootfs.join("var"))?;
    std::os::unix::fs::symlink("../run", rootfs.join("var/run"))?;
    fs::write(
        dir.join("containers.conf"),
        "[containers]\ndefault_ulimits = []\n",
    )?;
    let strip = match arch {
        Arch::Amd64 => "strip",
        Arch::Arm64 => "aarch64-linux-gnu-strip",
    };
    let st = Command::new(strip)
        .arg("-o")
        .arg(rootfs.join("usr/local/bin/lastgasp"))
        .arg(bin)
        .status()
        .context("running strip")?;
    if !st.success() {
        bail!("strip {} failed", bin.display());
    }
    let mut packages: Vec<DebPackage> = Vec::new();
    for (lib, at) in libraries(bin, arch)? {
        let p = owner(&lib)?;
        if !packages.contains(&p) {
            packages.push(p);
        }
        let to = rootfs.join(at.strip_prefix("/").unwrap_or(&at));
        fs::create_dir_all(to.parent().expect("a library path has a directory"))?;
        fs::copy(&lib, &to).with_context(|| format!("copying {}", lib.display()))?;
    }
    fs::write(
        dir.join("Containerfile"),
        "# Made by cargo xtask image: the agent and its glibc, nothing else.\n\
         FROM scratch\nCOPY rootfs/ /\nENTRYPOINT [\"/usr/local/bin/lastgasp\"]\n",
    )?;
    build_replacing(
        &dir,
        &tag,
        podman(&dir)
            .args(["build", "--quiet", "--platform"])
            .arg(format!("linux/{}", arch.name()))
            .args(["-t", &tag])
            .arg(&dir),
    )
    .context("podman build")?;
    save_archive(&dir, &tag, &archive).context("podman save")?;
    println!("image: {tag}, saved as {}", archive.display());
    Ok(Image {
        tag,
        arch,
        archive,
        packages,
    })
}

/// The tag and the archive of the image for `arch`: this machine's arch
/// keeps the plain version tag.
fn names(target: &Path, arch: Arch, version: &str) -> (String, PathBuf) {
    let suffix = match arch {
        Arch::Amd64 => String::new(),
        a => format!("-{}", a.name()),
    };
    (
        format!("localhost/lastgasp:{version}{suffix}"),
        target.join(format!("image/lastgasp-{version}{suffix}.oci.tar")),
    )
}

/// The image `build` made, saved as a multi-arch OCI index (an
/// `oci-archive`): a podman manifest list holding each arch's image
/// (`Arch::ALL` in a release), pushed with its images.
pub fn save_index(target: &Path, images: &[Image], to: &Path) -> Result<()> {
    let dir = target.join("image");
    let first = images.first().context("no image for the index")?;
    let list = format!("{}-index", first.tag);
    let _ = podman(&dir)
        .args(["manifest", "rm", &list])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    crate::run(podman(&dir).args(["manifest", "create", &list]))
        .context("podman manifest create")?;
    for image in images {
        crate::run(podman(&dir).args([
            "manifest",
            "add",
            &list,
            &format!("containers-storage:{}", image.tag),
        ]))
        .with_context(|| format!("podman manifest add ({})", image.arch.name()))?;
    }
    let _ = fs::remove_file(to);
    crate::run(
        podman(&dir)
            .args([
                "manifest", "push", "--quiet", "--all", "--format", "oci", &list,
            ])
            .arg(format!("oci-archive:{}", to.display())),
    )
    .context("podman manifest push")?;
    Ok(())
}

/// The real-node scenarios' only other image (`vm-test --node`): a static
/// binary built here (`tests/vm/node/sleeper.c`: the pod sandbox's pause
/// process without arguments, a workload that takes N ms to stop with one),
/// `FROM scratch`, saved as an OCI archive. Returns (archive, tag).
pub fn sleeper(root: &Path, target: &Path) -> Result<(PathBuf, String)> {
    setup::ensure_debs(&[("podman", "podman"), ("runc", "runc"), ("gcc", "gcc")])?;
    let dir = target.join("image/sleeper");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("rootfs"))?;
    fs::write(
        dir.join("containers.conf"),
        "[containers]\ndefault_ulimits = []\n",
    )?;
    crate::run(
        Command::new("gcc")
            .args(["-static", "-O2", "-o"])
            .arg(dir.join("rootfs/sleeper"))
            .arg(root.join("tests/vm/node/sleeper.c")),
    )
    .context("gcc -static tests/vm/node/sleeper.c (needs Debian's libc6-dev)")?;
    fs::write(
        dir.join("Containerfile"),
        "# Made by cargo xtask vm-test --node: one static binary.\n\
         FROM scratch\nCOPY rootfs/ /\nENTRYPOINT [\"/sleeper\"]\n",
    )?;
    let tag = "localhost/lastgasp-sleeper:1".to_string();
    build_replacing(
        &dir,
        &tag,
        podman(&dir)
            .args(["build", "--quiet", "-t", &tag])
            .arg(&dir),
    )
    .context("podman build (sleeper)")?;
    let archive = target.join("image/lastgasp-sleeper.oci.tar");
    save_archive(&dir, &tag, &archive).context("podman save (sleeper)")?;
    Ok((archive, tag))
}

/// Where `build` saves the agent's image for `arch`, and its tag.
pub fn archive(root: &Path, target: &Path, arch: Arch) -> Result<(PathBuf, String)> {
    let (tag, archive) = names(target, arch, &env_version(root)?);
    Ok((archive, tag))
}

/// The shared libraries `bin` loads, each with where it goes in the image:
/// for this machine's arch as `ldd` resolves them; for arm64 the `NEEDED`
/// entries and the loader (`readelf`), from Debian's cross glibc, placed
/// where an arm64 Debian keeps them.
pub fn libraries(bin: &Path, arch: Arch) -> Result<Vec<(PathBuf, PathBuf)>> {
    if arch == Arch::Arm64 {
        let out = Command::new("aarch64-linux-gnu-readelf")
            .args(["-d", "-l"])
            .arg(bin)
            .output()
            .context("running aarch64-linux-gnu-readelf")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut libs = Vec::new();
        for l in text.lines() {
            if let Some(name) = l
                .split_once("Shared library: [")
                .and_then(|(_, r)| r.strip_suffix(']'))
            {
                libs.push((
                    Path::new(setup::CROSS_LIBS).join(name),
                    Path::new("/lib/aarch64-linux-gnu").join(name),
                ));
            }
            if let Some(interp) = l
                .split_once("[Requesting program interpreter: ")
                .and_then(|(_, r)| r.strip_suffix(']'))
            {
                let name = Path::new(interp)
                    .file_name()
                    .context("an interpreter path")?;
                libs.push((
                    Path::new(setup::CROSS_LIBS).join(name),
                    PathBuf::from(interp),
                ));
            }
        }
        if libs.len() < 2 {
            bail!(
                "readelf named no libraries and loader for {}:\n{text}",
                bin.display()
            );
        }
        return Ok(libs);
    }
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let libs: Vec<(PathBuf, PathBuf)> = text
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
        .map(|p| (PathBuf::from(p), PathBuf::from(p)))
        .collect();
    if libs.is_empty() {
        bail!("ldd named no library for {}:\n{text}", bin.display());
    }
    Ok(libs)
}

pub fn env_version(root: &Path) -> Result<String> {
    let text = fs::read_to_string(root.join("agent/Cargo.toml"))?;
    text.lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .map(|v| v.trim_end_matches('"').to_string())
        .context("no version in agent/Cargo.toml")
}

/// This machine's arch: `check_arms`. Another arch's image is only started
/// here, under qemu-user: its loader and libraries must resolve. Arming it
/// is a guest of that arch's job (`vm-test --arch arm64 image-arms`).
pub fn check(target: &Path, image: &Image) -> Result<()> {
    if image.arch == Arch::Amd64 {
        return check_arms(target, image);
    }
    setup::ensure_arm64_emulation()?;
    let dir = target.join("image");
    let out = podman(&dir)
        .args(["run", "--rm", "--platform"])
        .arg(format!("linux/{}", image.arch.name()))
        .args([&image.tag, "--version"])
        .output()
        .context("podman run --version")?;
    let said = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && said.starts_with("lastgasp "),
        "the {} image {} did not start under emulation: {}{}",
        image.arch.name(),
        image.tag,
        said,
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "image: {} starts ({}, under qemu-user): {}",
        image.tag,
        image.arch.name(),
        said.trim()
    );
    Ok(())
}

/// Runs the image as the DaemonSet runs the agent and waits for it to arm.
pub fn check_arms(target: &Path, image: &Image) -> Result<()> {
    let dir = target.join("image");
    let audit = dir.join("audit");
    fs::create_dir_all(&audit)?;
    let name = format!("lastgasp-image-check-{}", std::process::id());
    let mut child = podman(&dir)
        .args([
            "run",
            "--rm",
            "--name",
            &name,
            "--cap-drop",
            "ALL",
            "--cap-add",
            CAPS,
        ])
        .args(["--pid", "host", "--network", "host", "--read-only"])
        .args(["-v", "/sys/kernel/btf:/sys/kernel/btf:ro"])
        .args(["-v", "/sys/kernel/tracing:/sys/kernel/tracing"])
        .arg("-v")
        .arg(format!("{}:/var/lib/lastgasp", audit.display()))
        .arg(&image.tag)
        .args([
            "--json-logs",
            "run",
            "--standalone",
            "--no-dbus",
            "--metrics-listen",
            "off",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting podman run")?;
    let err = child.stderr.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    let armed = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => {
                let armed = l.contains("\"message\":\"armed\"");
                seen.push(l);
                if armed {
                    break true;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break false,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if Instant::now() > deadline => {
                break false
            }
            Err(_) => {}
        }
    };
    let _ = podman(&dir).args(["stop", "-t", "2", &name]).output();
    let _ = child.wait();
    if !armed {
        bail!(
            "the image {} did not arm in a container with the DaemonSet's capabilities ({CAPS}) and mounts; it said:\n{}",
            image.tag,
            seen.join("\n")
        );
    }
    println!(
        "image: {} armed in a container (podman, runc; caps {CAPS}; host PID and network; BTF read-only, tracefs)",
        image.tag
    );
    Ok(())
}

/// Runs `build` (which tags `tag`), then removes the image the tag named
/// before, if it changed: every build would otherwise leave one behind.
fn build_replacing(dir: &Path, tag: &str, build: &mut Command) -> Result<()> {
    let id = |tag: &str| {
        crate::cmd::output(podman(dir).args(["image", "inspect", "--format", "{{.Id}}", tag]))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let before = id(tag);
    crate::run(build)?;
    if let (Some(old), Some(new)) = (before, id(tag)) {
        if old != new {
            if let Err(e) = crate::cmd::output(podman(dir).args(["rmi", &old])) {
                println!("image: the image {tag} named before ({old}) stays: {e:#}");
            }
        }
    }
    Ok(())
}

/// `podman save` of `tag` into a fresh OCI archive.
fn save_archive(dir: &Path, tag: &str, archive: &Path) -> Result<()> {
    let _ = fs::remove_file(archive);
    crate::run(
        podman(dir)
            .args(["save", "--format", "oci-archive", "-o"])
            .arg(archive)
            .arg(tag),
    )
}
