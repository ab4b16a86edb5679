//! The DaemonSet's image, built from the root `Containerfile` with Debian's
//! podman: either its build stage compiles the agent (`From::Source`: a
//! release, as `podman build .` does anywhere) or the agent this host built
//! is laid out in the context (`From::Host`: `cargo xtask image` and the VM
//! tests, its `prebuilt` stage). Saved as an OCI archive under
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

mod base;
pub use base::Base;

/// The DaemonSet's added capabilities (deploy/kustomize/agent-daemonset.yaml;
/// tests/manifests/privileges.rs checks that list against the docs).
const CAPS: &str = "BPF,PERFMON,SYS_ADMIN,SYS_PTRACE";

pub struct Image {
    pub tag: String,
    pub arch: Arch,
    /// Where `build` saved it (an OCI archive).
    pub archive: PathBuf,
    /// The Debian packages of its base (the SBOM's base).
    pub packages: Vec<DebPackage>,
}

/// A Debian package installed in an image: name, version, architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct DebPackage {
    pub name: String,
    pub version: String,
    pub arch: String,
}

/// Where the image's agent comes from.
pub enum From<'a> {
    /// This binary, built on the host for the image's arch (the `prebuilt` stage).
    Host(&'a Path),
    /// The Containerfile's build stage, from the checkout (a release).
    Source,
}

/// Podman set up for this machine: its own storage under the target dir
/// (`target/image/storage-DRIVER`: `rm -rf target` resets it), overlay
/// where an overlay mount works, runc (crun refuses this kernel's hybrid
/// cgroups), and no default ulimits (setting RLIMIT_NOFILE/NPROC needs
/// CAP_SYS_RESOURCE, which a sandbox may lack).
fn podman(dir: &Path) -> Command {
    let driver = storage_driver(dir);
    let mut cmd = Command::new("podman");
    cmd.env("CONTAINERS_CONF", dir.join("containers.conf"))
        .arg("--root")
        .arg(dir.join(format!("storage-{driver}")))
        .arg("--runroot")
        .arg(run_root(dir, driver))
        .args(["--storage-driver", driver, "--runtime", "runc"]);
    cmd
}

/// overlay, or vfs where an overlay mount is refused (said once): vfs copies
/// every layer whole, and a release's build stage then fills ~20 GB (CI's
/// disk ran out there once) where overlay keeps ~4 GB.
fn storage_driver(dir: &Path) -> &'static str {
    static DRIVER: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    DRIVER.get_or_init(|| match overlay_mounts(&dir.join("overlay-probe")) {
        Ok(()) => "overlay",
        Err(e) => {
            println!(
                "image: podman's storage is vfs (every layer copied whole: ~20 GB for a \
                 release): an overlay mount is refused here: {e:#}"
            );
            "vfs"
        }
    })
}

/// Mounts and unmounts an overlay in `probe`.
fn overlay_mounts(probe: &Path) -> Result<()> {
    let _ = fs::remove_dir_all(probe);
    for d in ["lower", "upper", "work", "merged"] {
        fs::create_dir_all(probe.join(d))?;
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        probe.join("lower").display(),
        probe.join("upper").display(),
        probe.join("work").display()
    );
    crate::cmd::output(
        Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(probe.join("merged")),
    )?;
    crate::cmd::output(Command::new("umount").arg(probe.join("merged")))?;
    fs::remove_dir_all(probe)?;
    Ok(())
}

/// Podman's run state (mounts, locks) for the storage under `dir`: on /run,
/// which a reboot empties, one per storage.
fn run_root(dir: &Path, driver: &str) -> PathBuf {
    let hash = dir
        .to_string_lossy()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    PathBuf::from(format!("/run/lastgasp-podman/{hash:016x}-{driver}"))
}

/// The directory podman's configuration and the images' files live in.
fn podman_dir(target: &Path) -> Result<PathBuf> {
    let dir = target.join("image");
    fs::create_dir_all(&dir)?;
    fs::write(
        dir.join("containers.conf"),
        "[containers]\ndefault_ulimits = []\n",
    )?;
    Ok(dir)
}

/// The image of the agent for `arch`, from the root `Containerfile` over `base`.
pub fn build(
    root: &Path,
    target: &Path,
    from: From,
    arch: Arch,
    version: &str,
    base: Base,
) -> Result<Image> {
    setup::ensure_debs(&[("podman", "podman"), ("runc", "runc")])?;
    let dir = podman_dir(target)?;
    let (tag, archive) = names(target, arch, version);
    let base_args = base.build_args(&dir, arch)?;
    let mut cmd = podman(&dir);
    cmd.args(["build", "--platform"])
        .arg(format!("linux/{}", arch.name()))
        .args(["--build-arg", &format!("TARGETARCH={}", arch.name())])
        .args(["-t", &tag])
        .arg("-f")
        .arg(root.join("Containerfile"));
    cmd.args(&base_args);
    match from {
        From::Host(bin) => {
            let ctx = dir.join("context");
            lay_root(bin, arch, &ctx.join("prebuilt"))?;
            cmd.args(["--quiet", "--target", "prebuilt"]).arg(&ctx);
        }
        From::Source => {
            println!(
                "image: building {tag} from the Containerfile (its build stage compiles the agent)"
            );
            // Its downloads trust what this host trusts (a TLS-intercepting
            // proxy's CA, as on this workplace's machines).
            let ca = std::env::var_os("SSL_CERT_FILE")
                .map(PathBuf::from)
                .unwrap_or_else(|| "/etc/ssl/certs/ca-certificates.crt".into());
            if ca.is_file() {
                cmd.arg("--secret")
                    .arg(format!("id=ca,src={}", ca.display()));
            }
            cmd.arg(root);
        }
    }
    let started = Instant::now();
    build_replacing(&dir, &tag, &mut cmd).with_context(|| {
        format!(
            "podman build of {tag}{}",
            if base == Base::Registry {
                " (where no container registry is reachable, a local base: --local-base)"
            } else {
                ""
            }
        )
    })?;
    println!(
        "image: {tag} built in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let packages = base::packages(&dir, &tag)?;
    save_archive(&dir, &tag, &archive).context("podman save")?;
    println!("image: {tag}, saved as {}", archive.display());
    Ok(Image {
        tag,
        arch,
        archive,
        packages,
    })
}

/// The image's root as the Containerfile's build stage leaves it in /out:
/// the agent, stripped, and the directories the DaemonSet mounts over.
pub fn lay_root(bin: &Path, arch: Arch, out: &Path) -> Result<()> {
    let strip = match arch {
        Arch::Amd64 => {
            setup::ensure_debs(&[("strip", "binutils")])?;
            "strip"
        }
        Arch::Arm64 => {
            setup::ensure_cross(arch)?;
            "aarch64-linux-gnu-strip"
        }
    };
    match fs::remove_dir_all(out) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("emptying {}", out.display()))
        }
        _ => {}
    }
    for d in ["usr/local/bin", "var/lib/lastgasp", "etc/lastgasp", "host"] {
        fs::create_dir_all(out.join(d))?;
    }
    crate::run(
        Command::new(strip)
            .arg("-o")
            .arg(out.join("usr/local/bin/lastgasp"))
            .arg(bin),
    )
    .with_context(|| format!("{strip} {}", bin.display()))
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
    let tag = "localhost/lastgasp-sleeper:1".to_string();
    let archive = target.join("image/lastgasp-sleeper.oci.tar");
    let containerfile = "# Made by cargo xtask vm-test --node: one static binary.\n\
         FROM scratch\nCOPY rootfs/ /\nENTRYPOINT [\"/sleeper\"]\n";
    // Built once per source: a rebuild is another image (its creation time),
    // and the real node's preloaded disk is keyed on the archives' bytes.
    let source = root.join("tests/vm/node/sleeper.c");
    let mut key = fs::read(&source).with_context(|| format!("reading {}", source.display()))?;
    key.extend_from_slice(containerfile.as_bytes());
    let built_from = target.join("image/lastgasp-sleeper.source");
    if archive.is_file() && fs::read(&built_from).is_ok_and(|k| k == key) {
        return Ok((archive, tag));
    }
    let _ = fs::remove_file(&built_from);
    setup::ensure_debs(&[("podman", "podman"), ("runc", "runc"), ("gcc", "gcc")])?;
    // Its context; the images' storage is the release's (`podman_dir`).
    let dir = target.join("image/sleeper");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("rootfs"))?;
    let storage = podman_dir(target)?;
    crate::run(
        Command::new("gcc")
            .args(["-static", "-O2", "-o"])
            .arg(dir.join("rootfs/sleeper"))
            .arg(&source),
    )
    .context("gcc -static tests/vm/node/sleeper.c (needs Debian's libc6-dev)")?;
    fs::write(dir.join("Containerfile"), containerfile)?;
    build_replacing(
        &storage,
        &tag,
        podman(&storage)
            .args(["build", "--quiet", "-t", &tag])
            .arg(&dir),
    )
    .context("podman build (sleeper)")?;
    save_archive(&storage, &tag, &archive).context("podman save (sleeper)")?;
    fs::write(&built_from, &key)?;
    Ok((archive, tag))
}

/// Where `build` saves the agent's image for `arch`, and its tag.
pub fn archive(root: &Path, target: &Path, arch: Arch) -> Result<(PathBuf, String)> {
    let (tag, archive) = names(target, arch, &env_version(root)?);
    Ok((archive, tag))
}

/// The shared libraries `bin` (built for this machine) loads, as `ldd`
/// resolves them, each twice: where it is and where it goes.
pub fn libraries(bin: &Path) -> Result<Vec<(PathBuf, PathBuf)>> {
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
