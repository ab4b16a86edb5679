//! The episode as the decider keeps it, its knobs and what `tick` asks. What
//! a decision carries out is the contract in `lastgasp_common::wire::episode`
//! (`Live::record` maps one to the other).
use std::time::{Duration, SystemTime};

pub use lastgasp_common::wire::episode::{
    Action, Authority, BeforeCluster, Decision, Episode, ShutdownPath, TimelineEntry, MAX_TIMELINE,
};

use crate::{decide::Death, signal::Kind};

/// The episode under way: the decider's own state, private to it.
#[derive(Clone, Debug)]
pub(super) struct Live {
    pub(super) id: u32,
    pub(super) kind: Kind,
    pub(super) path: ShutdownPath,
    pub(super) timeline: Vec<TimelineEntry>,
    pub(super) timeline_omitted: u32,
    pub(super) deadline: Option<SystemTime>,
    pub(super) protected: bool,
    pub(super) forced: bool,
    pub(super) authority: Authority,
    pub(super) host_confirmed: bool,
    pub(super) marked: bool,
    pub(super) expected_end: Option<SystemTime>,
    pub(super) death: Option<Death>,
}

impl Live {
    /// As decisions carry it (to the audit, the act stage and the Node).
    pub(super) fn record(&self) -> Episode {
        Episode {
            id: self.id,
            kind: self.kind,
            path: self.path,
            timeline: self.timeline.clone(),
            timeline_omitted: self.timeline_omitted,
            deadline: self.deadline,
            protected: self.protected,
            forced: self.forced,
            authority: self.authority,
            host_confirmed: self.host_confirmed,
            marked: self.marked,
            expected_end: self.expected_end,
            death: self.death.clone(),
        }
    }
}

/// `t + d`, or the latest time a log can write when that is past it
/// (`timespan::latest`): a deadline from outside (a bus signal, a tool's
/// argument, the config) is never a panic, in the sum or in its record.
pub fn plus(t: SystemTime, d: Duration) -> SystemTime {
    let latest = crate::timespan::latest();
    t.checked_add(d)
        .map_or(latest, |x| x.min(latest))
        .max(t.min(latest))
}

/// The decider's knobs (the config's `trust` section).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecisionPolicy {
    /// How long a request waits for the host's confirmation.
    pub pending_expiry: Duration,
    /// How long an immediate shutdown may take before the host is asked.
    pub immediate_end: Duration,
    /// How far past a graceful deadline (or a scheduled time) the host is asked.
    pub graceful_margin: Duration,
    /// A graceful run's length when no deadline is known (the buckets' sum).
    pub graceful_length: Duration,
    /// After the host says a shutdown is under way, ask again this much later.
    pub recheck: Duration,
    /// How long a direct tool's exec stands as a proof of death without its
    /// reboot(2) reaching the kernel.
    pub direct_tool_within: Duration,
    /// Accept logind/systemd signals from peers that do not own the name
    /// (the kubelet's e2e `dbus-send` rig). Off in production.
    pub trust_unowned_bus_signals: bool,
}

impl Default for DecisionPolicy {
    fn default() -> Self {
        DecisionPolicy {
            pending_expiry: Duration::from_secs(60),
            immediate_end: Duration::from_secs(30),
            graceful_margin: Duration::from_secs(30),
            graceful_length: Duration::from_secs(30),
            recheck: Duration::from_secs(30),
            direct_tool_within: Duration::from_secs(5),
            trust_unowned_bus_signals: false,
        }
    }
}

/// What `tick` asks of the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Tick {
    Nothing,
    /// A decision to audit and act on (a pending request expired).
    Decided(Decision),
    /// Ask the host whether a shutdown is under way about this episode,
    /// then `host_answer`.
    AskHost(u32),
}
