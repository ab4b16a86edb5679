//! `cargo xtask test`: the lint gate, every suite, then the release (the DaemonSet's image
//! among it) and the VM subset (or SKIPPED with the reason).
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result};

use crate::{
    build::{build, ebpf_object, target_dir},
    cmd::{cargo, output, run},
    k8s, lint, previous, release, setup, vm,
};

pub fn test(root: &Path, args: &[String]) -> Result<()> {
    let clock = Clock(Instant::now());
    enough_disk(&target_dir(root))?;
    lint::lint(root)?;
    clock.done("lint");
    // The D-Bus tests run a private dbus-daemon and use dbus-send.
    setup::ensure_debs(&[("dbus-daemon", "dbus-daemon"), ("dbus-send", "dbus-bin")])?;
    // The alerts' unit tests (tests/monitoring.rs) run promtool.
    setup::ensure_debs(&[("promtool", "prometheus")])?;
    // The manifest tests render deploy/ with helm and kustomize.
    let manifest_tools = setup::ensure_manifest_tools()?;
    // The cluster tests also run against a real control plane.
    let control_plane = k8s::ensure(root)?;
    // The version-skew tests run the previous release's agent beside this one.
    let previous = previous::build(root, &crate::image::env_version(root)?)?;
    let bin = build(root, false)?;
    let obj = ebpf_object(root);
    let scratch = scratch(root)?;
    let mut cmd = cargo();
    cmd.current_dir(root)
        .args(["test", "--workspace"])
        .env("TMPDIR", &scratch)
        .env("LASTGASP_EBPF_OBJ", &obj)
        .env("LASTGASP_BIN", &bin)
        .env("LASTGASP_HELM", &manifest_tools.helm)
        .env("LASTGASP_KUSTOMIZE", &manifest_tools.kustomize)
        .env("LASTGASP_PROMTOOL", "promtool")
        .args(args);
    k8s::env(&mut cmd, &control_plane);
    match previous {
        Ok(p) => {
            cmd.env("LASTGASP_PREVIOUS_BIN", p.bin)
                .env("LASTGASP_PREVIOUS_VERSION", p.version);
        }
        Err(why) => println!("no previous release for the skew tests: {why}"),
    }
    // eBPF tests share the kernel's hooks: one at a time.
    if !args.iter().any(|a| a == "--") {
        cmd.args(["--", "--test-threads=1"]);
    }
    run(&mut cmd)?;
    clock.done("setup, build and cargo test");
    // Last: the DaemonSet's image, built by the Containerfile and
    // run as the DaemonSet runs it; then real shutdowns in a QEMU guest
    // (a named subset, vm::CI_SUBSET), or SKIPPED with the reason
    // (LASTGASP_VM=skip, or qemu cannot run here).
    if args.is_empty() {
        // The release (its images built by the Containerfile, the agent
        // compiled in its build stage, over a Debian base made here: no
        // container registry is reachable; checked to arm as the DaemonSet
        // runs it), pushed to a real registry and pulled back.
        let dist = release::release(root, None, crate::image::Base::Local)?;
        release::verify(root, &dist)?;
        clock.done("the release (both images) and its registry round trip");
        // The debug agent `test` just built: no second (release) build within CI's budget.
        let vm = vm::ci(root, || build(root, false));
        clock.done("the VM subset and the real node");
        vm?;
    } else {
        println!("SKIPPED VM scenarios: a test filter was given (`cargo xtask vm-test` runs them)");
    }
    std::fs::remove_dir_all(&scratch)
        .with_context(|| format!("removing the tests' scratch {}", scratch.display()))?;
    Ok(())
}

/// Each stage's time on stdout as it ends: CI keeps only the tail of the
/// output, and its budget is 90 min.
struct Clock(Instant);

impl Clock {
    fn done(&self, stage: &str) {
        println!(
            "xtask test: {stage} done at +{:.1} min",
            self.0.elapsed().as_secs_f64() / 60.0
        );
    }
}

/// The tests' temporary files (a control plane's etcd is 130 MB) go under
/// the target dir, emptied when a run starts and removed when it passes, so
/// no run leaves them behind in /tmp; a failed run's stay for reading.
fn scratch(root: &Path) -> Result<PathBuf> {
    let dir = target_dir(root).join("test-tmp");
    match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("emptying {}", dir.display()));
        }
        _ => {}
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    println!(
        "the tests' temporary files: {} (removed when the run passes)",
        dir.display()
    );
    Ok(dir)
}

/// A run from a clean checkout at its peak, with a margin (measured on
/// 2026-11-28, podman on overlay: 18.2 GB above the machine's packages and
/// caches, 13 GB of it staying under target/, the images' storage 2.5 GB of
/// that; on vfs the images' storage alone had passed 19 GB).
const RUN_NEEDS: u64 = 20 << 30;

/// Fails before building when the disk cannot hold the run: a full disk
/// shows otherwise as a linker's crash minutes later.
fn enough_disk(target: &Path) -> Result<()> {
    std::fs::create_dir_all(target)?;
    let out = output(Command::new("du").arg("-sB1").arg(target))?;
    let built: u64 = out
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("du's answer for {}: {out:?}", target.display()))?;
    let need = RUN_NEEDS.saturating_sub(built);
    let free = vm::require_free(
        target,
        need,
        &format!(
            "`cargo xtask test` (a run from a clean checkout needs about {}, {} of it built there already)",
            vm::mib(RUN_NEEDS),
            vm::mib(built)
        ),
    )?;
    println!(
        "disk: {} GiB free for {}, {} GiB built there already; the run needs about {} GiB more",
        free >> 30,
        target.display(),
        built >> 30,
        need >> 30
    );
    Ok(())
}
