//! `cargo xtask`: sets up the toolchain on a fresh machine (idempotently,
//! cached), builds the eBPF object and the agent, runs, tests and benchmarks.
mod image;
mod setup;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the build needs (nightly, rust-src, bpf-linker), cached.
    Setup,
    /// Build the eBPF object and the agent.
    Build {
        #[arg(long)]
        release: bool,
    },
    /// Build and start the agent standalone (no cluster); extra args go to `lastgasp run`.
    Run {
        #[arg(long)]
        release: bool,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run every test.
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Real shutdowns in a QEMU guest: the scenario matrix and the last-gasp race.
    VmTest(vm::Args),
    /// Build the DaemonSet's image from the release binary (podman, FROM
    /// scratch) and check that it arms in a container.
    Image,
    /// Run the benchmarks and print their table.
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.command {
        Cmd::Setup => {
            setup::ensure(&root)?;
        }
        Cmd::Build { release } => {
            build(&root, release)?;
        }
        Cmd::Run { release, args } => {
            let bin = build(&root, release)?;
            let mut cmd = Command::new(bin);
            cmd.arg("run");
            if args.is_empty() {
                cmd.args(["--standalone", "--audit-dir"])
                    .arg(root.join("target/audit"));
            } else {
                cmd.args(args);
            }
            run(&mut cmd)?;
        }
        Cmd::Test { args } => {
            // The D-Bus tests run a private dbus-daemon and use dbus-send.
            setup::ensure_debs(&[("dbus-daemon", "dbus-daemon"), ("dbus-send", "dbus-bin")])?;
            // The manifest tests render deploy/ with helm and kustomize.
            let manifest_tools = setup::ensure_manifest_tools()?;
            let bin = build(&root, false)?;
            let obj = ebpf_object(&root);
            let mut cmd = cargo();
            cmd.current_dir(&root)
                .args(["test", "--workspace"])
                .env("LASTGASP_EBPF_OBJ", &obj)
                .env("LASTGASP_BIN", &bin)
                .env("LASTGASP_HELM", &manifest_tools.helm)
                .env("LASTGASP_KUSTOMIZE", &manifest_tools.kustomize)
                .args(&args);
            // eBPF tests share the kernel's hooks: one at a time.
            if !args.iter().any(|a| a == "--") {
                cmd.args(["--", "--test-threads=1"]);
            }
            run(&mut cmd)?;
            // Last: the DaemonSet's image, built from the release binary and
            // run as the DaemonSet runs it; then real shutdowns in a QEMU guest
            // (a named subset, vm::CI_SUBSET), or SKIPPED with the reason
            // (LASTGASP_VM=skip, or qemu cannot run here).
            if args.is_empty() {
                let release = build(&root, true)?;
                let img = image::build(&root, &target_dir(&root), &release)?;
                image::check_arms(&target_dir(&root), &img)?;
                // The debug agent `test` just built: no second (release) build within CI's budget.
                vm::ci(&root, || build(&root, false))?;
            } else {
                println!("SKIPPED VM scenarios: a test filter was given (`cargo xtask vm-test` runs them)");
            }
        }
        Cmd::Image => {
            let bin = build(&root, true)?;
            let img = image::build(&root, &target_dir(&root), &bin)?;
            image::check_arms(&target_dir(&root), &img)?;
        }
        Cmd::VmTest(args) => {
            vm::vm_test(&root, args, |release| build(&root, release))?;
        }
        Cmd::Bench { args } => {
            let bin = build(&root, true)?;
            // The bench runs lastgasp-trigger from beside itself: build every
            // binary of the tests package, not only the bench.
            run(cargo()
                .current_dir(&root)
                .args([
                    "build",
                    "--release",
                    "--package",
                    "lastgasp-tests",
                    "--bins",
                ])
                .env("LASTGASP_EBPF_OBJ", ebpf_object(&root)))?;
            let trigger = target_dir(&root).join("release/lastgasp-trigger");
            if !trigger.exists() {
                bail!("{} is missing after the build", trigger.display());
            }
            let mut cmd = cargo();
            cmd.current_dir(&root)
                .args([
                    "run",
                    "--release",
                    "--package",
                    "lastgasp-tests",
                    "--bin",
                    "lastgasp-bench",
                    "--",
                ])
                .env("LASTGASP_EBPF_OBJ", ebpf_object(&root))
                .env("LASTGASP_BIN", &bin)
                .args(args);
            run(&mut cmd)?;
        }
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `CARGO_TARGET_DIR` when set, else `target/` of the workspace.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

fn ebpf_object(root: &Path) -> PathBuf {
    target_dir(root).join("ebpf/bpfel-unknown-none/release/lastgasp")
}

/// The binaries `build` makes, in one cargo invocation: one feature
/// resolution, so the API double (VM cluster mode) shares the agent's
/// dependency builds instead of adding a second set (53 crates rebuilt).
pub const BINS: [&str; 4] = ["--package", "lastgasp", "--package", "lastgasp-apidouble"];

/// Builds the eBPF object, then the agent around it (and the API double);
/// returns the agent's binary.
fn build(root: &Path, release: bool) -> Result<PathBuf> {
    let tools = setup::ensure(root)?;
    let mut cmd = Command::new("cargo");
    setup::clean_toolchain_env(&mut cmd);
    cmd.current_dir(root.join("agent-ebpf"))
        .arg(format!("+{}", tools.nightly))
        .args([
            "build",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .arg("--target-dir")
        .arg(target_dir(root).join("ebpf"))
        .env("RUSTFLAGS", "-C debuginfo=2 -C link-arg=--btf")
        .env("PATH", tools.path_with_linker()?);
    run(&mut cmd).context("building the eBPF object (agent-ebpf)")?;

    let mut cmd = cargo();
    cmd.current_dir(root)
        .arg("build")
        .args(BINS)
        .env("LASTGASP_EBPF_OBJ", ebpf_object(root));
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd).context("building the agent")?;
    Ok(target_dir(root).join(if release {
        "release/lastgasp"
    } else {
        "debug/lastgasp"
    }))
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{:?} failed: {status}", cmd.get_program());
    }
    Ok(())
}
