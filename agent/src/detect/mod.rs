//! Detectors: each turns what it sees into `ShutdownSignal`s.
pub(crate) mod actor;
pub mod ebpf;
pub mod final_sweep;
pub mod hooks;
pub(crate) mod host;
pub(crate) mod launch;
pub mod logind;
pub mod shutdown_hook;
pub mod systemd;
