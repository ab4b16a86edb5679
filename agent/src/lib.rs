//! lastgasp: sees every way a Linux node can shut down, and tells the cluster.
#![warn(unreachable_pub)]
// The product crates keep functions within 80 lines (clippy.toml); a
// table may say why it does not.
#![warn(clippy::too_many_lines)]
pub mod act;
pub mod agent;
pub mod apiserver;
pub mod bus;
pub mod check;
pub mod clock;
pub mod config;
pub mod controller;
pub mod decide;
pub mod detect;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
#[cfg(test)]
mod golden;
pub mod grace;
pub(crate) mod health;
pub mod host_files;
pub mod hostio;
pub(crate) mod http;
pub mod node;
pub mod preflight;
pub mod record;
pub mod signal;
pub(crate) mod timespan;
