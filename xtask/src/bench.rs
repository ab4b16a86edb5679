//! `cargo xtask bench`: the release agent and the bench binary, then the
//! bench's table (`flood`, `stdout`, `lastgasp`, `recovery`, `zone`, `sizing`, `--quick` select and shorten);
//! `cargo xtask bench fuzz` fuzzes the parsers instead (`fuzz.rs`).
use std::path::Path;

use anyhow::{bail, Result};

use crate::{
    build::{build, ebpf_object, target_dir},
    cmd::{cargo, run},
    k8s, setup,
};

pub fn bench(root: &Path, args: &[String]) -> Result<()> {
    // Fuzzing is a run of its own (`cargo xtask bench fuzz`).
    if args.first().map(String::as_str) == Some("fuzz") {
        return crate::fuzz::fuzz(root, &args[1..]);
    }
    let bin = build(root, true)?;
    // The bench runs lastgasp-trigger from beside itself: build every
    // binary of the tests package, not only the bench.
    run(cargo()
        .current_dir(root)
        .args([
            "build",
            "--release",
            "--package",
            "lastgasp-tests",
            "--bins",
        ])
        .env("LASTGASP_EBPF_OBJ", ebpf_object(root)))?;
    let trigger = target_dir(root).join("release/lastgasp-trigger");
    if !trigger.exists() {
        bail!("{} is missing after the build", trigger.display());
    }
    let mut cmd = cargo();
    cmd.current_dir(root)
        .args([
            "run",
            "--release",
            "--package",
            "lastgasp-tests",
            "--bin",
            "lastgasp-bench",
            "--",
        ])
        .env("LASTGASP_EBPF_OBJ", ebpf_object(root))
        .env("LASTGASP_BIN", &bin)
        .args(args);
    // The real control plane: the recovery bench needs it; the last-gasp
    // row beside the double's uses it when the binaries are here.
    let cp = k8s::ensure(root)?;
    let on_server = ["recovery", "zone", "sizing"];
    if cp.is_none() && args.iter().any(|a| on_server.contains(&a.as_str())) {
        bail!(
            "`bench recovery`, `bench zone` and `bench sizing` need the Kubernetes v1.32.13 binaries (see above)"
        );
    }
    k8s::env(&mut cmd, &cp);
    // The stdout rows stand beside bpftrace on the same tracepoint.
    let others = ["flood", "lastgasp", "recovery", "zone", "sizing"];
    if args.iter().any(|a| a == "stdout") || !args.iter().any(|a| others.contains(&a.as_str())) {
        setup::ensure_debs(&[("bpftrace", "bpftrace")])?;
        cmd.env("LASTGASP_BPFTRACE", "bpftrace");
    }
    // The zone and sizing benches apply the kustomize render to the real server.
    if args.iter().any(|a| a == "zone" || a == "sizing") {
        let tools = setup::ensure_manifest_tools()?;
        cmd.env("LASTGASP_HELM", &tools.helm)
            .env("LASTGASP_KUSTOMIZE", &tools.kustomize);
    }
    run(&mut cmd)?;
    Ok(())
}
