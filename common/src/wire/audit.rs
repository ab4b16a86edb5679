//! The audit log's lines (JSON lines under `/var/lib/lastgasp`): written by
//! the agent, read back by the next boot's agent (maybe a newer one), by
//! `lastgasp history` and by the VM harness.
use std::{borrow::Cow, time::SystemTime};

use serde::{Deserialize, Serialize};

use super::{
    episode::{Action, Decision},
    signal::ShutdownSignal,
};

pub const FILE_NAME: &str = "audit.jsonl";
/// Containers' records (a child PID namespace's reboot(2) or tool exec,
/// audit-only by rule), beside the node's and rotated on their own: no
/// container flood rotates the node's history away.
pub const CONTAINER_FILE_NAME: &str = "audit-containers.jsonl";
/// Where the agent keeps its audit log unless told otherwise.
pub const DEFAULT_DIR: &str = "/var/lib/lastgasp";

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct AuditRecord {
    pub boot_id: String,
    /// Order within the boot.
    pub seq: u64,
    #[serde(with = "humantime_serde")]
    pub written_at: SystemTime,
    #[serde(flatten)]
    pub entry: Entry,
}

/// What a record holds: a detection and what was decided, or what an
/// action achieved.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "kebab-case")]
// A record per detection, written once: a box would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Entry {
    Signal {
        signal: ShutdownSignal,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decision: Option<Decision>,
    },
    Outcome {
        episode: u32,
        outcome: Outcome,
    },
    /// The agent started in this boot (so that a boot with no shutdown
    /// record still shows up, and its end is known to be unannounced).
    AgentStart {
        version: String,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "outcome", rename_all = "kebab-case")]
pub enum Outcome {
    /// The graceful path finished its buckets.
    GracefulDone { terminated: usize, remaining: usize },
    /// The last gasp reached the API server, `ms` after the kernel saw it.
    LastGaspDelivered { ms: f64 },
    /// The last gasp failed; the record is delivered after the next boot.
    LastGaspFailed { error: String },
    /// A cancellation was applied.
    Cancelled,
    /// The episode's expected end passed with the agent still alive and the
    /// host saying no shutdown is under way: every mark was undone.
    Abandoned { why: String },
    /// The episode's proof of death was wrong and nothing else confirmed
    /// the shutdown: every mark was undone, the record closed as failed.
    Failed { why: String },
    /// The episode's proof of death was wrong; the shutdown the host
    /// confirmed goes on, its record written again without the proof.
    Withdrawn { why: String },
    /// A request that was never confirmed (pending) ran out: nothing was
    /// done.
    Expired { why: String },
    /// Episode `episode` of boot `boot_id` reached the cluster only in this
    /// later boot.
    DeliveredLate { boot_id: String },
    /// Written in a later boot: the Node's record annotation held episode
    /// `episode` of boot `boot_id` (the cluster acknowledged it before that
    /// boot ended) where the audit log lacked its record or its delivery.
    /// `record` is the Node's copy.
    FoundOnNode {
        boot_id: String,
        record: serde_json::Value,
    },
}

impl Outcome {
    /// The name serde writes (`"outcome": "graceful-done"`).
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::GracefulDone { .. } => "graceful-done",
            Outcome::LastGaspDelivered { .. } => "last-gasp-delivered",
            Outcome::LastGaspFailed { .. } => "last-gasp-failed",
            Outcome::Cancelled => "cancelled",
            Outcome::Abandoned { .. } => "abandoned",
            Outcome::Failed { .. } => "failed",
            Outcome::Withdrawn { .. } => "withdrawn",
            Outcome::Expired { .. } => "expired",
            Outcome::DeliveredLate { .. } => "delivered-late",
            Outcome::FoundOnNode { .. } => "found-on-node",
        }
    }
}

impl AuditRecord {
    pub fn signal(&self) -> Option<&ShutdownSignal> {
        match &self.entry {
            Entry::Signal { signal, .. } => Some(signal),
            Entry::Outcome { .. } | Entry::AgentStart { .. } => None,
        }
    }
}

/// What the agent prints on stdout per detection (`--print`): the signal,
/// and the action decided (the audit line carries the episode too).
/// Borrowed when written (the hot path copies nothing), owned when read.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StdoutLine<'a> {
    #[serde(flatten)]
    pub signal: Cow<'a, ShutdownSignal>,
    pub decision: Cow<'a, Action>,
}
