//! The CPU architectures the agent and its image are built for.
use std::path::{Path, PathBuf};

/// A CPU architecture the agent and its image are built for, by its
/// Debian and OCI name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    /// This machine's (x86_64).
    #[default]
    Amd64,
    /// aarch64, cross-compiled (Debian's gcc-aarch64-linux-gnu links it).
    Arm64,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::Amd64, Arch::Arm64];

    pub fn name(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }

    /// Rust's target triple, `None` for this machine's own.
    pub fn rust_target(self) -> Option<&'static str> {
        match self {
            Arch::Amd64 => None,
            Arch::Arm64 => Some("aarch64-unknown-linux-gnu"),
        }
    }

    /// The agent's binary as `build_for` leaves it under `target`.
    pub fn agent_binary(self, target: &Path, release: bool) -> PathBuf {
        let mut dir = target.to_path_buf();
        if let Some(t) = self.rust_target() {
            dir.push(t);
        }
        dir.join(if release { "release" } else { "debug" })
            .join("lastgasp")
    }
}
