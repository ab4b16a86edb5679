//! Detectors: each turns what it sees into `ShutdownSignal`s.
pub mod actor;
pub mod clock;
pub mod ebpf;
pub mod hooks;
pub mod host;
pub mod launch;
pub mod logind;
pub mod systemd;
