//! `cargo xtask`: sets up the toolchain on a fresh machine (idempotently,
//! cached), builds the eBPF object and the agent, runs, tests and benchmarks.
#![warn(clippy::too_many_lines)]
mod arch;
mod bench;
mod build;
mod cmd;
mod fuzz;
mod image;
mod k8s;
mod lint;
mod previous;
mod release;
mod setup;
mod test;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Result;
use build::{build, ebpf_object, target_dir, BINS};
use clap::{Parser, Subcommand};
use cmd::run;

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
    /// The style gate: rustfmt's check and clippy (warnings denied) on every
    /// crate, the eBPF crate included. `test` runs it first.
    Lint,
    /// Run every test (after `lint`).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Real shutdowns in a QEMU guest: the scenario matrix and the last-gasp race.
    VmTest(vm::Args),
    /// Build the DaemonSet's image around the release binary built here
    /// (the Containerfile's `prebuilt` stage) and check that it arms in a
    /// container (another arch's: that it starts, under qemu-user).
    Image {
        #[arg(long, value_enum, default_value_t)]
        arch: arch::Arch,
        /// Debian's base made here with debootstrap instead of pulled from
        /// docker.io (for hosts that reach no container registry).
        #[arg(long)]
        local_base: bool,
    },
    /// The Containerfile's build stage: build the release agent for
    /// `arch` and lay out the image's root in `out`.
    #[command(hide = true)]
    ImageRoot {
        #[arg(long, value_enum)]
        arch: arch::Arch,
        #[arg(long)]
        out: PathBuf,
    },
    /// The release artefacts in target/dist/VERSION: image archives and a
    /// multi-arch OCI index, the chart package, an SBOM, notes, SHA256SUMS.
    Release {
        /// Also push them to a local registry and pull them back, as an operator would.
        #[arg(long)]
        verify: bool,
        /// Where the image will be pushed (REGISTRY/PATH/lastgasp): the
        /// chart's default image, pinned by the index's digest.
        #[arg(long, env = "LASTGASP_IMAGE_REPOSITORY")]
        image_repository: Option<String>,
        /// Debian's base made here with debootstrap instead of pulled from
        /// docker.io (for hosts that reach no container registry).
        #[arg(long)]
        local_base: bool,
    },
    /// Print the name `release` gives this checkout: X.Y.Z at its tag
    /// vX.Y.Z, X.Y.Z-dev.gSHA on any other commit.
    Version,
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
        Cmd::Setup => setup::ensure(&root).map(drop),
        Cmd::Build { release } => build(&root, release).map(drop),
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
            run(&mut cmd)
        }
        Cmd::Test { args } => test::test(&root, &args),
        Cmd::Image { arch, local_base } => {
            let bin = build::build_for(&root, true, arch)?;
            let version = image::env_version(&root)?;
            let target = target_dir(&root);
            let from = image::From::Host(&bin);
            let img = image::build(&root, &target, from, arch, &version, base(local_base))?;
            image::check(&target, &img)
        }
        Cmd::ImageRoot { arch, out } => {
            let bin = build::image_agent(&root, arch)?;
            image::lay_root(&bin, arch, &out)
        }
        Cmd::VmTest(args) => vm::vm_test(&root, args, |release| build(&root, release)),
        Cmd::Release {
            verify,
            image_repository,
            local_base,
        } => {
            let dist = release::release(&root, image_repository.as_deref(), base(local_base))?;
            if verify {
                release::verify(&root, &dist)?;
            }
            Ok(())
        }
        Cmd::Version => {
            println!("{}", release::version_name(&root)?);
            Ok(())
        }
        Cmd::Bench { args } => bench::bench(&root, &args),
        Cmd::Lint => lint::lint(&root),
    }
}

fn base(local: bool) -> image::Base {
    if local {
        image::Base::Local
    } else {
        image::Base::Registry
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}
