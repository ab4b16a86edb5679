//! The shutdown record: what the agent writes on its own Node (the
//! annotation `lastgasp.dev/last-shutdown`), and what the controller, the
//! next boot's report and `lastgasp history` read. One typed, versioned
//! struct; nothing else builds or picks apart the annotation.
//!
//! Version 2 adds the proof of death (`episode.death`) and `closed`.
//! Version skew: a controller reads both versions; a version-1 record (an
//! older agent) is evidence only where it came from the kernel itself (a
//! reboot(2) or a kernel power-off hook), its `back` and `abandoned` flags
//! read as `closed`. An older controller does not understand `closed` or
//! the proof: upgrade the controller before the agents.
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::{
    episode::{Death, Episode, Proof},
    signal::{Kind, Scope, ShutdownSignal, Source},
};
use crate::names::{PROOF_ANNOTATION, RECORD_ANNOTATION};

/// The format this agent writes.
pub const VERSION: u32 = 2;
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(try_from = "Wire")]
pub struct ShutdownRecord {
    /// The format's version (1 when absent: agents before the proof).
    pub v: u32,
    /// The boot the record was written in.
    pub boot_id: String,
    /// When the signal that wrote it was seen (the node's clock).
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub at: Option<SystemTime>,
    /// The episode: its kind, path, timeline and proof of death.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode: Option<Episode>,
    /// The signal that wrote it, in short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<SignalSummary>,
    /// The episode ended without the node going down on it, or the node came
    /// back: the record is evidence of nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed: Option<Closed>,
    /// Delivered after the next boot (the last gasp did not get out in time).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delivered_late: bool,
}

/// The record as either version writes it.
#[derive(Deserialize)]
struct Wire {
    #[serde(default = "v1")]
    v: u32,
    boot_id: String,
    #[serde(default, with = "humantime_serde")]
    at: Option<SystemTime>,
    #[serde(default)]
    episode: Option<Episode>,
    #[serde(default)]
    signal: Option<SignalSummary>,
    #[serde(default)]
    closed: Option<Closed>,
    #[serde(default)]
    delivered_late: bool,
    // Version 1's way of closing a record.
    #[serde(default)]
    back: bool,
    #[serde(default)]
    abandoned: bool,
    #[serde(default)]
    abandoned_why: Option<String>,
}

fn v1() -> u32 {
    1
}

impl TryFrom<Wire> for ShutdownRecord {
    type Error = String;

    fn try_from(w: Wire) -> Result<Self, String> {
        if w.v > VERSION {
            return Err(format!(
                "record version {} is newer than this build's {VERSION}",
                w.v
            ));
        }
        let at = w.at.or(w.signal.as_ref().map(|s| s.at));
        let closed = w.closed.or_else(|| {
            (w.back || w.abandoned).then(|| Closed {
                how: if w.back {
                    Closing::Back
                } else {
                    Closing::Abandoned
                },
                at: at.unwrap_or(SystemTime::UNIX_EPOCH),
                why: w.abandoned_why.unwrap_or_default(),
            })
        });
        Ok(ShutdownRecord {
            v: w.v,
            boot_id: w.boot_id,
            at,
            episode: w.episode,
            signal: w.signal,
            closed,
            delivered_late: w.delivered_late,
        })
    }
}

/// The signal as the record carries it: the hook's raw detail, the caller's
/// ancestry and cgroup stay in the node's audit log.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SignalSummary {
    pub source: Source,
    pub kind: Kind,
    pub forced: bool,
    pub scope: Scope,
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<ActorSummary>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ActorSummary {
    pub pid: u32,
    pub comm: String,
    pub uid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub euid: Option<u32>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Closed {
    pub how: Closing,
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    pub why: String,
}

/// How an episode's record was closed.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Closing {
    /// The shutdown was called off by the authority that opened it.
    Cancelled,
    /// Its expected end passed and the host had no shutdown under way, or
    /// the agent restarted in the same boot and the host had none.
    Abandoned,
    /// A request never confirmed.
    Expired,
    /// The node lived on after its proof of death (a reboot(2) that returned).
    Failed,
    /// The node came back on a new boot.
    Back,
}

impl std::fmt::Display for Closing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::String(s)) => f.write_str(&s),
            _ => Err(std::fmt::Error),
        }
    }
}

impl ShutdownRecord {
    /// The record of `ep` as `s` leaves it, in `boot_id`.
    pub fn new(boot_id: &str, s: &ShutdownSignal, ep: &Episode) -> Self {
        ShutdownRecord {
            v: VERSION,
            boot_id: boot_id.to_string(),
            at: Some(s.at),
            episode: Some(ep.clone()),
            signal: Some(SignalSummary {
                source: s.source,
                kind: s.kind,
                forced: s.forced,
                scope: s.scope,
                at: s.at,
                actor: s.actor.as_ref().map(|a| ActorSummary {
                    pid: a.pid,
                    comm: a.comm.clone(),
                    uid: a.uid,
                    euid: a.euid,
                }),
            }),
            closed: None,
            delivered_late: false,
        }
    }

    /// The record of `ep` as a decision made by time leaves it (no signal of
    /// its own), at `at`.
    pub fn of_episode(boot_id: &str, ep: &Episode, at: SystemTime) -> Self {
        ShutdownRecord {
            v: VERSION,
            boot_id: boot_id.to_string(),
            at: Some(at),
            episode: Some(ep.clone()),
            signal: None,
            closed: None,
            delivered_late: false,
        }
    }

    /// An earlier boot's episode, delivered after the next boot: closed as
    /// back at once (it only completes the story).
    pub fn late(boot_id: &str, ep: &Episode, now: SystemTime) -> Self {
        ShutdownRecord {
            v: VERSION,
            boot_id: boot_id.to_string(),
            at: ep.timeline.first().map(|e| e.at),
            episode: Some(ep.clone()),
            signal: None,
            closed: Some(Closed {
                how: Closing::Back,
                at: now,
                why: "delivered after the next boot".into(),
            }),
            delivered_late: true,
        }
    }

    /// Reads an annotation's text: an error says why it is no record.
    pub fn parse(raw: &str) -> Result<Self, String> {
        serde_json::from_str(raw).map_err(|e| format!("not a shutdown record: {e}"))
    }

    pub fn to_json(&self) -> String {
        // Serialising plain data cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The shutdown's kind: the episode's (filled in by later signals), else
    /// the signal's.
    pub fn kind(&self) -> Kind {
        match (&self.episode, &self.signal) {
            (Some(ep), _) if ep.kind != Kind::Unknown => ep.kind,
            (_, Some(s)) => s.kind,
            (Some(ep), None) => ep.kind,
            (None, None) => Kind::Unknown,
        }
    }

    /// The proof that the node's kernel went down. A version-1 record has
    /// none of its own: one that came from the kernel (a reboot(2) that
    /// older agents recorded only from callers that could reboot, or a
    /// kernel hook) counts as the kernel's.
    pub fn death(&self) -> Option<Death> {
        if let Some(d) = self.episode.as_ref().and_then(|e| e.death.clone()) {
            return Some(d);
        }
        let s = self.signal.as_ref()?;
        (self.v < 2
            && s.scope == Scope::Node
            && matches!(s.source, Source::RebootSyscall | Source::KernelHook))
        .then(|| Death {
            pid: None,
            proof: Proof::Kernel,
            at: s.at,
            by: format!("{} (a version-1 record)", s.source),
        })
    }

    /// Which episode the record is of.
    pub fn key(&self) -> EpisodeKey {
        EpisodeKey {
            boot_id: self.boot_id.clone(),
            id: self.episode.as_ref().map(|e| e.id),
            opened: self
                .episode
                .as_ref()
                .and_then(|e| e.timeline.first())
                .map(|t| t.at),
        }
    }

    /// The proof annotation's value: `<proof>/<boot id>` while open with a
    /// proof of death.
    pub fn proof_mark(&self) -> Option<String> {
        let d = self.death().filter(|_| self.closed.is_none())?;
        let proof = serde_json::to_value(d.proof).ok()?;
        Some(format!("{}/{}", proof.as_str()?, self.boot_id))
    }

    /// The Node annotations of every write of the record: the record, and
    /// the proof annotation set or removed with it (a merge patch's `null`).
    pub fn annotations(&self) -> serde_json::Value {
        serde_json::json!({
            RECORD_ANNOTATION: self.to_json(),
            PROOF_ANNOTATION: self.proof_mark(),
        })
    }

    /// The record, closed.
    pub fn closed(mut self, how: Closing, why: &str, at: SystemTime) -> Self {
        self.closed = Some(Closed {
            how,
            at,
            why: why.to_string(),
        });
        self
    }
}

/// An episode, across agent restarts: episode ids start again at 1 in
/// each agent process, so the time its first signal was seen is part of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpisodeKey {
    pub boot_id: String,
    pub id: Option<u32>,
    pub opened: Option<SystemTime>,
}

impl EpisodeKey {
    pub fn of(boot_id: &str, ep: &Episode) -> Self {
        EpisodeKey {
            boot_id: boot_id.to_string(),
            id: Some(ep.id),
            opened: ep.timeline.first().map(|t| t.at),
        }
    }
}

/// The value of [`UNANNOUNCED_ANNOTATION`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UnannouncedEnd {
    /// The boot that ended unannounced.
    #[serde(rename = "bootID")]
    pub boot_id: String,
    /// The agent's last line in that boot's audit log: it was alive then.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub last_seen: Option<SystemTime>,
    /// When the next boot's agent found it.
    #[serde(with = "humantime_serde")]
    pub reported_at: SystemTime,
}

/// The drain's end as the agent says it in its `Drained` condition's message
/// (and the Event beside it): how many pods went, how many were left, the
/// one that took longest. The ledger reads it back ([`DrainNote::parse`]).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct DrainNote {
    pub gone: u32,
    pub left: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowest: Option<SlowPod>,
}

/// A pod of the drain and its seconds from the request to its end.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SlowPod {
    pub pod: String,
    pub seconds: f64,
}

const DRAIN_DONE: &str = "graceful shutdown done: ";

impl std::fmt::Display for DrainNote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{DRAIN_DONE}{} pods terminated, {} still running",
            self.gone, self.left
        )?;
        match &self.slowest {
            Some(s) => write!(f, "; slowest {} {:.1} s", s.pod, s.seconds),
            None => Ok(()),
        }
    }
}

impl DrainNote {
    /// The note from its text; `None` for any other text.
    pub fn parse(text: &str) -> Option<DrainNote> {
        let rest = text.strip_prefix(DRAIN_DONE)?;
        let (counts, slowest) = match rest.split_once("; slowest ") {
            Some((c, s)) => (c, Some(s)),
            None => (rest, None),
        };
        let (gone, left) = counts.split_once(" pods terminated, ")?;
        let slowest = match slowest {
            None => None,
            Some(s) => {
                let (pod, secs) = s.strip_suffix(" s")?.rsplit_once(' ')?;
                Some(SlowPod {
                    pod: pod.to_string(),
                    seconds: secs.parse().ok()?,
                })
            }
        };
        Some(DrainNote {
            gone: gone.parse().ok()?,
            left: left.strip_suffix(" still running")?.parse().ok()?,
            slowest,
        })
    }
}
