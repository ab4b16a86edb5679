//! The real Kubernetes control plane for the tests: etcd from
//! Debian's `etcd-server`, and kube-apiserver, kube-controller-manager and
//! kube-scheduler v1.32.13 from the workplace's tools directory, checked
//! against the checksums pinned here (not only the file beside them) and
//! unpacked once into `~/.cache/lastgasp/kubernetes-v1.32.13/`.
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::setup;

pub const VERSION: &str = "v1.32.13";

/// (binary, sha256 of its .xz, sha256 of the binary).
const BINARIES: &[(&str, &str, &str)] = &[
    (
        "kube-apiserver",
        "2fe1ab05edfbe39905ff5c9511483b7fd49b00db3d0b7a57bb435151bf8402fc",
        "fdf386369a2c078f9266ba6c475edda88017b75d19eb61e8f5eedb8d2aeef530",
    ),
    (
        "kube-controller-manager",
        "3b9be772a67aa56b78445aed4108ea9c746729950f4f5ee269a394823927df2c",
        "93cb393b0400f87259b22b8d22f59b6e940bd1953a98b0ce10bf605bdd01df9d",
    ),
    (
        "kube-scheduler",
        "4f41f70c525e58aa6a390929b97459e5ec341d3d52d92bf4362b880f84dff2e4",
        "937ad3758f8846ff2ddff9ebe8e4ba4ab7890dcac9b63274149771050302958d",
    ),
    // For the real node in the VM guest (`vm-test --node`).
    (
        "kubelet",
        "cd2efdb8fd3705b5bf1c5d3a27136abacbf22a8e09262eb0b2012b5f0b878fd2",
        "4aa455b2e8af69af9a4c07eeda7cea34e3f6a6fe97f4c10b0f89c6b9acf53864",
    ),
];

/// Where the compressed binaries are: `LASTGASP_K8S_TOOLS`, else the
/// workplace's `shared/tools/kubernetes-v1.32.13` beside the checkout or
/// beside one of its parents (a CI checkout may sit deeper).
pub(crate) fn tools_dir(root: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("LASTGASP_K8S_TOOLS") {
        return PathBuf::from(dir);
    }
    let rel = format!("shared/tools/kubernetes-{VERSION}");
    root.ancestors()
        .skip(1)
        .map(|a| a.join(&rel))
        .find(|d| d.join("kube-apiserver.xz").is_file())
        .unwrap_or_else(|| root.join("..").join(&rel))
}

pub struct ControlPlaneBinaries {
    /// Holds kube-apiserver, kube-controller-manager, kube-scheduler.
    pub bin_dir: PathBuf,
    pub etcd: PathBuf,
}

/// The control plane's binaries, ready to run; `Ok(None)` with the reason
/// printed when the compressed binaries are not on this machine (the tests
/// that need them then say SKIPPED). A checksum that does not match is an
/// error, never a skip.
pub fn ensure(root: &Path) -> Result<Option<ControlPlaneBinaries>> {
    let src = tools_dir(root);
    if !src.join("kube-apiserver.xz").is_file() {
        println!(
            "SKIPPED the real control plane: no kube-apiserver.xz in {} (set LASTGASP_K8S_TOOLS to \
             the directory holding the {VERSION} binaries)",
            src.display()
        );
        return Ok(None);
    }
    setup::ensure_debs(&[("etcd", "etcd-server"), ("xz", "xz-utils")])?;
    let bin_dir = setup::cache_dir().join(format!("kubernetes-{VERSION}"));
    fs::create_dir_all(&bin_dir)?;
    for (name, xz_sum, bin_sum) in BINARIES {
        let dest = bin_dir.join(name);
        if dest.is_file() && sha256(&dest)? == *bin_sum {
            continue;
        }
        let xz = src.join(format!("{name}.xz"));
        let got = sha256(&xz)?;
        if got != *xz_sum {
            bail!(
                "{} has sha256 {got}, expected {xz_sum}: not the {VERSION} binary this project pins",
                xz.display()
            );
        }
        eprintln!(
            "xtask: unpacking {} into {}",
            xz.display(),
            bin_dir.display()
        );
        let staged = bin_dir.join(format!(".{name}.{}.part", std::process::id()));
        let out = fs::File::create(&staged)?;
        let st = Command::new("xz")
            .arg("-dc")
            .arg(&xz)
            .stdout(out)
            .status()
            .context("running xz")?;
        if !st.success() {
            bail!("xz -dc {} failed", xz.display());
        }
        let got = sha256(&staged)?;
        if got != *bin_sum {
            let _ = fs::remove_file(&staged);
            bail!("{name} unpacked to sha256 {got}, expected {bin_sum}");
        }
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&staged, fs::Permissions::from_mode(0o755))?;
        fs::rename(&staged, &dest)?;
    }
    let etcd = which("etcd").context("etcd (Debian's etcd-server) is not on PATH")?;
    Ok(Some(ControlPlaneBinaries { bin_dir, etcd }))
}

fn sha256(path: &Path) -> Result<String> {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("running sha256sum")?;
    if !out.status.success() {
        bail!("sha256sum {} failed", path.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

fn which(cmd: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(cmd))
        .find(|p| p.is_file())
}

/// Sets the variables the tests read: LASTGASP_K8S_BIN and LASTGASP_ETCD.
pub fn env(cmd: &mut Command, cp: &Option<ControlPlaneBinaries>) {
    if let Some(cp) = cp {
        cmd.env("LASTGASP_K8S_BIN", &cp.bin_dir)
            .env("LASTGASP_ETCD", &cp.etcd);
    }
}
