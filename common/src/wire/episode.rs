//! The episode as the decision core leaves it: every audit line and the
//! Node's record carry it, and the next boot (maybe a newer agent) and the
//! controller (maybe another version) read it back.
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::signal::{Kind, Source};

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ShutdownPath {
    /// A request waits for the host to confirm it: nothing done yet.
    Pending,
    /// A shutdown is announced for later: warn, nothing to stop yet.
    Scheduled,
    Graceful,
    Immediate,
    Cancelled,
    /// The expected end passed and no shutdown came: marks undone.
    Abandoned,
    /// A pending request was never confirmed.
    Expired,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case", tag = "action")]
pub enum Action {
    /// Record it; the node is not affected.
    AuditOnly { why: String },
    /// A request that may not happen: wait for the host to confirm it.
    Pending {
        #[serde(with = "humantime_serde")]
        expires: SystemTime,
    },
    /// A shutdown is due at `due`: tell the cluster early.
    Warn {
        #[serde(with = "humantime_serde")]
        due: Option<SystemTime>,
    },
    /// Start (or, from a warning, begin) the graceful path.
    Graceful {
        #[serde(with = "humantime_serde")]
        deadline: Option<SystemTime>,
        /// A logind delay lock holds the shutdown for us.
        protected: bool,
    },
    /// No time: send the last gasp now. `escalated` when a graceful episode
    /// was under way.
    Immediate { escalated: bool },
    /// The kernel itself is going down in an episode that already told the
    /// cluster: the record goes out once more, with the proof of death
    /// ([`Episode::death`]), as the agent's last word.
    LastWord,
    /// The shutdown was called off: undo what the episode did.
    Cancel,
    /// The episode's proof of death was wrong (its reboot(2) returned, its
    /// tool ended or outlived [`DecisionPolicy::direct_tool_within`]
    /// without one) and nothing else confirms the shutdown: every mark
    /// undone, the record closed as failed.
    Fail { why: String },
    /// The episode's proof of death was wrong, but logind, systemd or PID 1
    /// confirmed the shutdown: it goes on, and its record goes out again
    /// without the proof.
    Withdraw { why: String },
    /// The shutdown did not come: undo every mark the episode made.
    Abandon { why: String },
    /// A pending request ran out unconfirmed: nothing was done.
    Expire { why: String },
    /// Part of the episode under way; nothing new to do.
    Join,
}

impl Action {
    /// The name serde writes (`"action": "audit-only"`).
    pub fn name(&self) -> &'static str {
        match self {
            Action::AuditOnly { .. } => "audit-only",
            Action::Pending { .. } => "pending",
            Action::Warn { .. } => "warn",
            Action::Graceful { .. } => "graceful",
            Action::Immediate { .. } => "immediate",
            Action::LastWord => "last-word",
            Action::Cancel => "cancel",
            Action::Fail { .. } => "fail",
            Action::Withdraw { .. } => "withdraw",
            Action::Abandon { .. } => "abandon",
            Action::Expire { .. } => "expire",
            Action::Join => "join",
        }
    }

    /// The reason an action carries, when it carries one.
    pub fn why(&self) -> Option<&str> {
        match self {
            Action::AuditOnly { why }
            | Action::Fail { why }
            | Action::Withdraw { why }
            | Action::Abandon { why }
            | Action::Expire { why } => Some(why),
            _ => None,
        }
    }
}

/// What an action does while the cluster has not joined yet (the agent
/// started without the API server).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BeforeCluster {
    /// Waits for it whole (logind's delay lock holds the shutdown).
    Held,
    /// Waits for it within the last gasp's own bound.
    Bounded,
    /// Ends the episode: nothing held is sent any more.
    Clears,
    /// Needs nothing of it now.
    Nothing,
}

impl Action {
    /// Whether it moves anything (the node, the cluster, the lock): its
    /// audit line is durable before it acts.
    pub fn moves(&self) -> bool {
        match self {
            Action::AuditOnly { .. } | Action::Pending { .. } | Action::Join => false,
            Action::Warn { .. }
            | Action::Graceful { .. }
            | Action::Immediate { .. }
            | Action::LastWord
            | Action::Cancel
            | Action::Fail { .. }
            | Action::Withdraw { .. }
            | Action::Abandon { .. }
            | Action::Expire { .. } => true,
        }
    }

    /// Whether a graceful run under way stops here (a new one stops the
    /// old itself).
    pub fn ends_graceful_run(&self) -> bool {
        match self {
            Action::Immediate { .. }
            | Action::Cancel
            | Action::Abandon { .. }
            | Action::Fail { .. } => true,
            Action::AuditOnly { .. }
            | Action::Pending { .. }
            | Action::Warn { .. }
            | Action::Graceful { .. }
            | Action::LastWord
            | Action::Withdraw { .. }
            | Action::Expire { .. }
            | Action::Join => false,
        }
    }

    /// The last gasp: no time to wait for the disk, its patches leave while
    /// its audit line syncs (with a cluster to send them to).
    pub fn leaves_no_time(&self) -> bool {
        matches!(self, Action::Immediate { .. } | Action::LastWord)
    }

    pub fn before_cluster(&self) -> BeforeCluster {
        match self {
            Action::Graceful { .. } | Action::Warn { .. } => BeforeCluster::Held,
            Action::Immediate { .. } | Action::LastWord => BeforeCluster::Bounded,
            Action::Cancel
            | Action::Abandon { .. }
            | Action::Expire { .. }
            | Action::Fail { .. } => BeforeCluster::Clears,
            Action::AuditOnly { .. }
            | Action::Pending { .. }
            | Action::Withdraw { .. }
            | Action::Join => BeforeCluster::Nothing,
        }
    }
}

/// As the audit writes it: `{"action":"audit-only","why":"..."}`.
impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let json = serde_json::to_string(self).map_err(|_| std::fmt::Error)?;
        f.write_str(&json)
    }
}

/// How strong a claim's source is: who could have caused it. A cancel needs
/// at least the strength that opened (or last confirmed) the episode.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Authority {
    /// Anyone can ask (an unprivileged request).
    Request,
    /// A caller that can reboot (CAP_SYS_BOOT, or a signal the kernel let
    /// reach PID 1).
    Privileged,
    /// logind or systemd themselves (the owners of their bus names).
    Host,
    /// The kernel is shutting down: reboot(2), its power-off functions, PID 1
    /// running systemd-shutdown.
    Kernel,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TimelineEntry {
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    pub source: Source,
    pub kind: Kind,
    pub summary: String,
}

/// An episode's timeline keeps its first entry and the newest, this many
/// in all: the episode (in every audit line and in the Node's record) stays
/// a few kilobytes however many requests join it.
pub const MAX_TIMELINE: usize = 32;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Episode {
    /// 1, 2, ... within this boot.
    pub id: u32,
    pub kind: Kind,
    pub path: ShutdownPath,
    /// Every signal that joined, in order: the first, then the newest
    /// (`MAX_TIMELINE` in all; a flood of joining requests cannot grow it).
    pub timeline: Vec<TimelineEntry>,
    /// Entries left out of `timeline` (after its first).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub timeline_omitted: u32,
    #[serde(with = "humantime_serde")]
    pub deadline: Option<SystemTime>,
    pub protected: bool,
    pub forced: bool,
    /// The strongest source that confirmed it.
    #[serde(default = "Authority::request")]
    pub authority: Authority,
    /// logind, systemd or PID 1 confirmed it (not only the caller's own
    /// request and reboot(2) call).
    #[serde(default)]
    pub host_confirmed: bool,
    /// The cluster was told (warn, graceful or immediate): undo on an end
    /// other than the shutdown itself.
    #[serde(default)]
    pub marked: bool,
    /// When the node should be gone (or the request confirmed) by.
    #[serde(default, with = "humantime_serde")]
    pub expected_end: Option<SystemTime>,
    /// What shows that the node's kernel is going down now, the strongest
    /// seen: the controller fences only on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub death: Option<Death>,
}

impl Authority {
    fn request() -> Self {
        Authority::Request
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub action: Action,
    /// The episode after this signal (none for audit-only outside one).
    pub episode: Option<Episode>,
}

/// How sure the agent is that the node's kernel goes down now, weakest
/// first.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Proof {
    /// A caller that can reboot ran a tool that calls reboot(2) itself at
    /// once: nothing is stopped first, the kubelet lives until the kernel
    /// goes down, so its silence is the kernel's end.
    DirectTool,
    /// systemd's final stage: systemd-shutdown ran its own hooks (every
    /// service stopped, every other process killed, the file systems
    /// unmounted; only the final sync and reboot(2) left, and they wait for
    /// the agent's word), or lastgasp's final unit ran, right before
    /// systemd-{verb}.service: every unit stopped (every pod's scope, the
    /// kubelet, the runtime), every mount unit unmounted.
    FinalStage,
    /// The kernel's own power-off: a reboot(2) from a caller that can reboot,
    /// in the node's PID namespace (PID 1's last step after every process
    /// was stopped, or a direct caller), or the kernel's power-off functions.
    Kernel,
}

/// The proof of death an episode carries into the record.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Death {
    pub proof: Proof,
    /// When the signal that proves it was seen (the node's clock).
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    /// What was seen, and by whom.
    pub by: String,
    /// The process (global pid) whose exec or reboot(2) proves it: its end
    /// without the kernel going down withdraws the proof.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_action_s_name_is_the_one_serde_writes() {
        let t = SystemTime::UNIX_EPOCH;
        let why = || "x".to_string();
        for a in [
            Action::AuditOnly { why: why() },
            Action::Pending { expires: t },
            Action::Warn { due: None },
            Action::Graceful {
                deadline: None,
                protected: true,
            },
            Action::Immediate { escalated: false },
            Action::LastWord,
            Action::Cancel,
            Action::Fail { why: why() },
            Action::Withdraw { why: why() },
            Action::Abandon { why: why() },
            Action::Expire { why: why() },
            Action::Join,
        ] {
            let v = serde_json::to_value(&a).unwrap();
            assert_eq!(v["action"], a.name(), "{a}");
            assert_eq!(v.get("why").and_then(|w| w.as_str()), a.why(), "{a}");
            // Only what moves nothing waits for the disk's batch; only the
            // last gasp leaves beside its sync; what is held before the
            // cluster joins is what moves the Node.
            let quiet = matches!(a.name(), "audit-only" | "pending" | "join");
            assert_eq!(a.moves(), !quiet, "{a}");
            assert_eq!(
                a.leaves_no_time(),
                matches!(a.name(), "immediate" | "last-word"),
                "{a}"
            );
            if a.before_cluster() != BeforeCluster::Nothing {
                assert!(a.moves(), "{a}");
            }
        }
    }
}
