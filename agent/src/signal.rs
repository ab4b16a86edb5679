//! The one event type that flows from detection to decision to action
//! (its types are the contract in `lastgasp_common::wire::signal`), and
//! what the host answers when asked whether a shutdown is under way.
pub use lastgasp_common::wire::signal::*;

/// Asks the host whether a shutdown is under way (logind, systemd).
pub type HostQuery = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = HostAnswer> + Send>>
        + Send
        + Sync,
>;

/// What the host says when asked whether a shutdown is under way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostAnswer {
    /// Yes, with the evidence (logind preparing, a systemd shutdown job...).
    UnderWay(String),
    /// Neither logind nor systemd has a shutdown under way.
    NotUnderWay,
    /// Nobody could be asked (no bus), with why.
    Unknown(String),
}
