//! `cargo xtask lint`: the style gate, first step of `cargo xtask test`.
//! rustfmt's check on every crate (the eBPF crate and the fuzz targets
//! included) and clippy with warnings denied on the workspace and on the eBPF
//! crate (built for its own target with the pinned nightly); the release
//! workflow checked against GitHub's schema and audited by zizmor.
use std::{path::Path, process::Command};

use anyhow::{Context, Result};

use crate::{
    build::{build_ebpf, ebpf_cargo, ebpf_object},
    cmd::{cargo, run},
    setup,
};

pub fn lint(root: &Path) -> Result<()> {
    let tools = setup::ensure(root)?;
    setup::ensure_style_tools()?;
    run(cargo().current_dir(root).args(["fmt", "--all", "--check"]))
        .context("the workspace is not rustfmt-clean: run `cargo fmt --all`")?;
    // The crates outside the workspace, by their root files (rustfmt
    // follows their modules and reads the repository's rustfmt.toml).
    let mut roots = vec![root.join("agent-ebpf/src/main.rs")];
    for e in std::fs::read_dir(root.join("fuzz/fuzz_targets"))? {
        roots.push(e?.path());
    }
    run(Command::new("rustfmt")
        .args(["--check", "--edition", "2021"])
        .args(&roots))
    .context("agent-ebpf or fuzz is not rustfmt-clean: run rustfmt on the files above")?;
    // The agent embeds the eBPF object: it is built first (as `build` does).
    build_ebpf(root, &tools)?;
    run(cargo()
        .current_dir(root)
        .args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])
        .env("LASTGASP_EBPF_OBJ", ebpf_object(root)))
    .context("clippy found something in the workspace")?;
    let mut ebpf = ebpf_cargo(root, &tools, "clippy");
    ebpf.args(["--", "-D", "warnings"]);
    run(&mut ebpf).context("clippy found something in agent-ebpf")?;
    // Offline: no audit that asks GitHub; an invalid workflow fails.
    let zizmor = setup::ensure_zizmor()?;
    run(Command::new(zizmor)
        .args(["--offline", "--strict-collection", "--no-progress"])
        .arg(root.join(".github/workflows")))
    .context("zizmor found something in .github/workflows")?;
    println!("lint: rustfmt, clippy and zizmor clean");
    Ok(())
}
