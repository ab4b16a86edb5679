//! Detectors: each turns what it sees into `ShutdownSignal`s.
pub mod actor;
pub mod btf;
pub mod dbus;
pub mod decode;
pub mod ebpf;
pub mod logind;
pub mod systemd;
