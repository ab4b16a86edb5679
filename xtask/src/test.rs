//! `cargo xtask test`: the lint gate, every suite, then the release (the DaemonSet's image
//! among it) and the VM subset (or SKIPPED with the reason).
use std::path::Path;

use anyhow::Result;

use crate::{
    build::{build, ebpf_object},
    cmd::{cargo, run},
    k8s, lint, release, setup, vm,
};

pub fn test(root: &Path, args: &[String]) -> Result<()> {
    lint::lint(root)?;
    // The D-Bus tests run a private dbus-daemon and use dbus-send.
    setup::ensure_debs(&[("dbus-daemon", "dbus-daemon"), ("dbus-send", "dbus-bin")])?;
    // The alerts' unit tests (tests/monitoring.rs) run promtool.
    setup::ensure_debs(&[("promtool", "prometheus")])?;
    // The manifest tests render deploy/ with helm and kustomize.
    let manifest_tools = setup::ensure_manifest_tools()?;
    // The cluster tests also run against a real control plane.
    let control_plane = k8s::ensure(root)?;
    let bin = build(root, false)?;
    let obj = ebpf_object(root);
    let mut cmd = cargo();
    cmd.current_dir(root)
        .args(["test", "--workspace"])
        .env("LASTGASP_EBPF_OBJ", &obj)
        .env("LASTGASP_BIN", &bin)
        .env("LASTGASP_HELM", &manifest_tools.helm)
        .env("LASTGASP_KUSTOMIZE", &manifest_tools.kustomize)
        .env("LASTGASP_PROMTOOL", "promtool")
        .args(args);
    k8s::env(&mut cmd, &control_plane);
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
        // The release (its image built from the release binary and
        // checked to arm as the DaemonSet runs it), pushed to a real
        // registry and pulled back.
        let dist = release::release(root)?;
        release::verify(&dist)?;
        // The debug agent `test` just built: no second (release) build within CI's budget.
        vm::ci(root, || build(root, false))?;
    } else {
        println!("SKIPPED VM scenarios: a test filter was given (`cargo xtask vm-test` runs them)");
    }
    Ok(())
}
