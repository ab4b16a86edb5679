//! `cargo xtask bench fuzz [--runs N] [TARGET...]`: every fuzz target in
//! `fuzz/` (each parser of outside data) for a fixed number of executions
//! with cargo-fuzz (libFuzzer, AddressSanitizer) on the eBPF build's
//! nightly. The corpora stay in `fuzz/corpus/` (minimised after the run);
//! a crash leaves its input in `fuzz/artifacts/TARGET/` and fails the run.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, Context, Result};

use crate::{
    build::{build, ebpf_object},
    setup::{self, cache_dir, clean_toolchain_env},
};

const CARGO_FUZZ_VERSION: &str = "0.13.2";
pub const TARGETS: [&str; 6] = [
    "kernel_record",
    "exec_record",
    "node_record",
    "config",
    "audit_log",
    "dbus_body",
];
const DEFAULT_RUNS: u64 = 10_000_000;

/// cargo-fuzz, installed once into the cache, checked after installing.
fn ensure_cargo_fuzz() -> Result<PathBuf> {
    let root = cache_dir().join(format!("tools/cargo-fuzz-{CARGO_FUZZ_VERSION}"));
    let bin = root.join("bin/cargo-fuzz");
    let works = || {
        Command::new(&bin)
            .args(["fuzz", "--version"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !works() {
        eprintln!("xtask: installing cargo-fuzz {CARGO_FUZZ_VERSION} (once)");
        let mut cmd = Command::new("cargo");
        clean_toolchain_env(&mut cmd);
        let status = cmd
            .args([
                "install",
                "--locked",
                "--force",
                &format!("cargo-fuzz@{CARGO_FUZZ_VERSION}"),
                "--root",
            ])
            .arg(&root)
            .status()?;
        if !status.success() || !works() {
            bail!("installing cargo-fuzz {CARGO_FUZZ_VERSION} failed; by hand: cargo install cargo-fuzz@{CARGO_FUZZ_VERSION} --root {}", root.display());
        }
    }
    Ok(bin)
}

/// libFuzzer's last "Done N runs in S second(s)" line.
fn done_line(stderr: &str) -> Option<(u64, u64)> {
    stderr.lines().rev().find_map(|l| {
        let rest = l.split("Done ").nth(1)?;
        let mut w = rest.split_whitespace();
        let runs = w.next()?.parse().ok()?;
        let secs = w.nth(2)?.parse().ok()?;
        Some((runs, secs))
    })
}

/// `[--runs N] [TARGET...]`: executions per target, and the targets (all
/// when none is named).
fn fuzz_args(args: &[String]) -> Result<(u64, Vec<String>)> {
    let mut runs = DEFAULT_RUNS;
    let mut targets = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => {
                runs = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .context("--runs N: a number of executions per target")?;
            }
            t if TARGETS.contains(&t) => targets.push(t.to_string()),
            other => bail!(
                "bench fuzz: unknown argument {other:?} (targets: {})",
                TARGETS.join(", ")
            ),
        }
    }
    if targets.is_empty() {
        targets = TARGETS
            .iter()
            .map(std::string::ToString::to_string)
            .collect();
    }
    Ok((runs, targets))
}

pub fn fuzz(root: &Path, args: &[String]) -> Result<()> {
    let (runs, targets) = fuzz_args(args)?;
    // The agent's build script embeds the eBPF object: build it first.
    build(root, true)?;
    let tools = setup::ensure(root)?;
    let cargo_fuzz = ensure_cargo_fuzz()?;
    let fuzz_dir = root.join("fuzz");
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for t in &targets {
        let corpus = fuzz_dir.join("corpus").join(t);
        fs::create_dir_all(&corpus)?;
        let artifacts = fuzz_dir.join("artifacts").join(t);
        let before = count(&artifacts);
        let started = Instant::now();
        // `cargo fuzz SUB TARGET CORPUS` on the nightly, with the eBPF object.
        let fuzz = |sub: &str| {
            let mut cmd = Command::new(&cargo_fuzz);
            clean_toolchain_env(&mut cmd);
            cmd.current_dir(root)
                .env("RUSTUP_TOOLCHAIN", &tools.nightly)
                .env("LASTGASP_EBPF_OBJ", ebpf_object(root))
                .args(["fuzz", sub, "--fuzz-dir"])
                .arg(&fuzz_dir)
                .arg(t)
                .arg(&corpus);
            cmd
        };
        let out = fuzz("run")
            .args([
                "--",
                &format!("-runs={runs}"),
                "-max_len=4096",
                "-print_final_stats=1",
            ])
            .output()
            .with_context(|| format!("running cargo fuzz run {t}"))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        let crashes = count(&artifacts) - before;
        let (done, secs) = done_line(&stderr).unwrap_or((0, started.elapsed().as_secs()));
        if !out.status.success() {
            let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
            eprintln!(
                "{t}: cargo fuzz failed:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
            failed.push(if crashes > 0 {
                format!("{t}: {crashes} crash(es), inputs in fuzz/artifacts/{t}/")
            } else {
                format!("{t}: cargo fuzz failed without a crash input (a build error? see above)")
            });
        }
        // Minimised, so the corpus kept in the repository stays small.
        let _ = fuzz("cmin").output();
        rows.push(format!(
            "| {t} | {done} | {secs} s | {} /s | {crashes} | {} inputs |",
            done.checked_div(secs).unwrap_or(done),
            count(&corpus)
        ));
    }
    println!("| target | executions | time | rate | crashes | corpus (minimised) |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    if !failed.is_empty() {
        bail!("fuzzing failed: {}", failed.join("; "));
    }
    Ok(())
}

fn count(dir: &Path) -> usize {
    fs::read_dir(dir)
        .map(std::iter::Iterator::count)
        .unwrap_or(0)
}
