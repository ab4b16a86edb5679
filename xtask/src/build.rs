//! Building: the eBPF object with the pinned nightly and bpf-linker, then
//! the agent around it; and the command helpers every subcommand uses.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::arch::Arch;
use crate::{
    cmd::{cargo, run},
    setup,
};

/// `CARGO_TARGET_DIR` when set, else `target/` of the workspace.
pub fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

pub fn ebpf_object(root: &Path) -> PathBuf {
    target_dir(root).join("ebpf/bpfel-unknown-none/release/lastgasp")
}

/// The binaries `build` makes, in one cargo invocation: one feature
/// resolution, so the API double (VM cluster mode) shares the agent's
/// dependency builds instead of adding a second set.
pub const BINS: [&str; 4] = ["--package", "lastgasp", "--package", "lastgasp-apidouble"];

/// The agent alone for `arch` (the eBPF object is the same bytecode for
/// every arch); this machine's arch is `build`.
pub fn build_for(root: &Path, release: bool, arch: Arch) -> Result<PathBuf> {
    if arch.rust_target().is_none() {
        return build(root, release);
    }
    agent(root, release, arch, &[])
}

/// The release agent alone for `arch`, without debug info (the image
/// strips it anyway): the Containerfile's build stage.
pub fn image_agent(root: &Path, arch: Arch) -> Result<PathBuf> {
    agent(root, true, arch, &[("CARGO_PROFILE_RELEASE_DEBUG", "0")])
}

fn agent(root: &Path, release: bool, arch: Arch, env: &[(&str, &str)]) -> Result<PathBuf> {
    let tools = setup::ensure(root)?;
    build_ebpf(root, &tools)?;
    setup::ensure_cross(arch)?;
    let mut cmd = cargo();
    cmd.current_dir(root)
        .args(["build", "--package", "lastgasp"])
        .env("LASTGASP_EBPF_OBJ", ebpf_object(root));
    if let Some(triple) = arch.rust_target() {
        cmd.args(["--target", triple]);
    }
    for (var, val) in setup::cross_env(arch)
        .into_iter()
        .chain(env.iter().copied())
    {
        cmd.env(var, val);
    }
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd).with_context(|| format!("building the agent for {}", arch.name()))?;
    Ok(arch.agent_binary(&target_dir(root), release))
}

/// Builds the eBPF object, then the agent around it (and the API double);
/// returns the agent's binary.
pub fn build(root: &Path, release: bool) -> Result<PathBuf> {
    let tools = setup::ensure(root)?;
    build_ebpf(root, &tools)?;
    let mut cmd = cargo();
    cmd.current_dir(root)
        .arg("build")
        .args(BINS)
        .env("LASTGASP_EBPF_OBJ", ebpf_object(root));
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd).context("building the agent")?;
    Ok(Arch::Amd64.agent_binary(&target_dir(root), release))
}

pub fn build_ebpf(root: &Path, tools: &setup::Tools) -> Result<()> {
    let mut cmd = ebpf_cargo(root, tools, "build");
    cmd.env("RUSTFLAGS", "-C debuginfo=2 -C link-arg=--btf")
        .env("PATH", tools.path_with_linker()?);
    run(&mut cmd).context("building the eBPF object (agent-ebpf)")
}

/// `cargo <subcommand>` on the eBPF crate: the pinned nightly, for
/// bpfel-unknown-none with its own `core`, in `target/ebpf`.
pub fn ebpf_cargo(root: &Path, tools: &setup::Tools, subcommand: &str) -> Command {
    let mut cmd = Command::new("cargo");
    setup::clean_toolchain_env(&mut cmd);
    cmd.current_dir(root.join("agent-ebpf"))
        .arg(format!("+{}", tools.nightly))
        .args([
            subcommand,
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .arg("--target-dir")
        .arg(target_dir(root).join("ebpf"));
    cmd
}
