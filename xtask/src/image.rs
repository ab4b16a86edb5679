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

use anyhow::{bail, Context, Result};

use crate::setup;

/// The DaemonSet's added capabilities (deploy/kustomize/agent-daemonset.yaml;
/// tests/manifests.rs checks that list against the docs).
const CAPS: &str = "BPF,PERFMON,SYS_ADMIN,SYS_PTRACE";

pub struct Image {
    pub tag: String,
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

pub fn build(root: &Path, target: &Path, bin: &Path) -> Result<Image> {
    setup::ensure_debs(&[
        ("podman", "podman"),
        ("runc", "runc"),
        ("strip", "binutils"),
    ])?;
    let dir = target.join("image");
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
    let st = Command::new("strip")
        .arg("-o")
        .arg(rootfs.join("usr/local/bin/lastgasp"))
        .arg(bin)
        .status()
        .context("running strip")?;
    if !st.success() {
        bail!("strip {} failed", bin.display());
    }
    for lib in libraries(bin)? {
        let to = rootfs.join(lib.strip_prefix("/").unwrap_or(&lib));
        fs::create_dir_all(to.parent().expect("a library path has a directory"))?;
        fs::copy(&lib, &to).with_context(|| format!("copying {}", lib.display()))?;
    }
    fs::write(
        dir.join("Containerfile"),
        "# Made by cargo xtask image: the agent and its glibc, nothing else.\n\
         FROM scratch\nCOPY rootfs/ /\nENTRYPOINT [\"/usr/local/bin/lastgasp\"]\n",
    )?;
    let version = env_version(root)?;
    let tag = format!("localhost/lastgasp:{version}");
    crate::run(
        podman(&dir)
            .args(["build", "--quiet", "-t", &tag])
            .arg(&dir),
    )
    .context("podman build")?;
    let archive = dir.join(format!("lastgasp-{version}.oci.tar"));
    let _ = fs::remove_file(&archive);
    crate::run(
        podman(&dir)
            .args(["save", "--format", "oci-archive", "-o"])
            .arg(&archive)
            .arg(&tag),
    )
    .context("podman save")?;
    println!("image: {tag}, saved as {}", archive.display());
    Ok(Image { tag })
}

/// The image `build` made, saved as a multi-arch OCI index (an
/// `oci-archive`): a podman manifest list holding each arch's image
/// (`release::ARCHES`), pushed with its images.
pub fn save_index(target: &Path, image: &Image, to: &Path) -> Result<()> {
    let dir = target.join("image");
    let list = format!("{}-index", image.tag);
    let _ = podman(&dir)
        .args(["manifest", "rm", &list])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    crate::run(podman(&dir).args(["manifest", "create", &list]))
        .context("podman manifest create")?;
    crate::run(podman(&dir).args([
        "manifest",
        "add",
        &list,
        &format!("containers-storage:{}", image.tag),
    ]))
    .context("podman manifest add")?;
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
    crate::run(
        podman(&dir)
            .args(["build", "--quiet", "-t", &tag])
            .arg(&dir),
    )
    .context("podman build (sleeper)")?;
    let archive = target.join("image/lastgasp-sleeper.oci.tar");
    let _ = fs::remove_file(&archive);
    crate::run(
        podman(&dir)
            .args(["save", "--format", "oci-archive", "-o"])
            .arg(&archive)
            .arg(&tag),
    )
    .context("podman save (sleeper)")?;
    Ok((archive, tag))
}

/// Where `build` saved the agent's image, and its tag.
pub fn archive(root: &Path, target: &Path) -> Result<(PathBuf, String)> {
    let version = env_version(root)?;
    Ok((
        target.join(format!("image/lastgasp-{version}.oci.tar")),
        format!("localhost/lastgasp:{version}"),
    ))
}

/// The shared libraries `bin` loads, as `ldd` resolves them.
pub fn libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let libs: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split_whitespace().find(|w| w.starts_with('/')))
        .map(PathBuf::from)
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
