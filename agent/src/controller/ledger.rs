//! The fleet's shutdown ledger: one `NodeShutdown` (`lastgasp.dev/v1alpha1`,
//! cluster-scoped, `deploy/kustomize/nodeshutdown-crd.yaml`) per shutdown
//! episode of a node, written by the controller alone from what the API
//! server holds: the node's record (its episode, proof and close), this
//! controller's fence and the node's return on a new boot. [`entry`] reads a
//! Node; [`merge`] keeps what the Node no longer shows (a fence lifted when
//! the node came back). What the agent says of the caller stays the agent's
//! claim (`agentClaims`).
use std::time::SystemTime;

use k8s_openapi::api::core::v1::{Node, NodeCondition};
use kube::ResourceExt;
use lastgasp_common::names::{DRAINED, DRAIN_IN_PROGRESS};
use serde::{Deserialize, Serialize};

use super::{metrics::EntryLabels, rule, FENCED_BOOT_ANNOTATION};
use crate::{
    decide::{Proof, ShutdownPath, TimelineEntry},
    record::{self, ActorSummary, Closed, Closing, DrainNote, ShutdownRecord},
    signal::Kind,
};

pub const GROUP: &str = "lastgasp.dev";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "NodeShutdown";
pub const PLURAL: &str = "nodeshutdowns";

/// How an episode ended, as far as the cluster knows.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Ending {
    /// Under way: no proof of the end yet.
    Open,
    /// The record proves the kernel's end; not fenced (yet, or by policy).
    Down,
    Fenced,
    /// Ready again on a new boot.
    Back,
    Cancelled,
    Abandoned,
    Expired,
    /// The node lived on after its proof (a reboot(2) that returned).
    Failed,
    /// A boot ended with no shutdown its agent saw (a power loss, a reset,
    /// a panic): the next boot's agent said so.
    Unannounced,
}

impl Spec {
    /// What an entry is counted by (labels, metrics, the summary): kind,
    /// path, ending and graceful, as the object spells them.
    pub fn labels(&self) -> EntryLabels {
        let word = |v: serde_json::Value| v.as_str().unwrap_or_default().to_string();
        EntryLabels {
            kind: word(serde_json::json!(self.kind)),
            path: word(serde_json::json!(self.path)),
            ending: word(serde_json::json!(self.ending)),
            graceful: self.graceful.to_string(),
        }
    }

    /// The same, as (name, value) pairs in that order.
    pub fn facets(&self) -> [(&'static str, String); 4] {
        let l = self.labels();
        [
            ("kind", l.kind),
            ("path", l.path),
            ("ending", l.ending),
            ("graceful", l.graceful),
        ]
    }
}

/// The episode's path (the decider's), or `unannounced`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Path {
    Pending,
    Scheduled,
    Graceful,
    Immediate,
    Cancelled,
    Abandoned,
    Expired,
    Unannounced,
}

impl From<ShutdownPath> for Path {
    fn from(p: ShutdownPath) -> Path {
        match p {
            ShutdownPath::Pending => Path::Pending,
            ShutdownPath::Scheduled => Path::Scheduled,
            ShutdownPath::Graceful => Path::Graceful,
            ShutdownPath::Immediate => Path::Immediate,
            ShutdownPath::Cancelled => Path::Cancelled,
            ShutdownPath::Abandoned => Path::Abandoned,
            ShutdownPath::Expired => Path::Expired,
        }
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub node: String,
    #[serde(rename = "bootID")]
    pub boot_id: String,
    pub episode: u32,
    pub kind: Kind,
    pub path: Path,
    pub graceful: bool,
    pub forced: bool,
    #[serde(with = "humantime_serde")]
    pub opened_at: SystemTime,
    pub ending: Ending,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delivered_late: bool,
    pub agent_claims: Claims,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub down: Option<Down>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<Fence>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub back: Option<Back>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed: Option<Closed>,
}

/// The agent's word: the signal that wrote the record, its caller, the timeline.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct Claims {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<ActorSummary>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<TimelineEntry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<Drain>,
}

/// The graceful path's drain as the agent's conditions on the Node say it:
/// `DrainInProgress` True since `started`, `Drained` at `ended` with the
/// counts and the slowest pod of its message (the node's clock).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct Drain {
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub started: Option<SystemTime>,
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub ended: Option<SystemTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained: Option<bool>,
    #[serde(flatten)]
    pub note: Option<DrainNote>,
}

impl Drain {
    /// From the drain's start to its end, when both were seen.
    pub fn took(&self) -> Option<std::time::Duration> {
        self.ended?.duration_since(self.started?).ok()
    }
}

/// The drain of the episode opened at `opened`: the agent's conditions
/// written since then (whole seconds), a `Drained` only with its note.
fn drain(node: &Node, opened: SystemTime) -> Option<Drain> {
    let since = |c: &NodeCondition| {
        let t = SystemTime::from(c.last_transition_time.as_ref()?.0);
        (t + std::time::Duration::from_secs(1) >= opened).then_some(t)
    };
    let started = rule::condition(node, DRAIN_IN_PROGRESS)
        .filter(|c| c.status == "True")
        .and_then(since);
    let done = rule::condition(node, DRAINED).and_then(|c| {
        let note = DrainNote::parse(c.message.as_deref()?)?;
        Some((since(c)?, c.status == "True", note))
    });
    if started.is_none() && done.is_none() {
        return None;
    }
    Some(Drain {
        started,
        ended: done.as_ref().map(|d| d.0),
        drained: done.as_ref().map(|d| d.1),
        note: done.map(|d| d.2),
    })
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Down {
    pub proof: Proof,
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
    pub by: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Fence {
    /// The API server's time of the fence (the controller's write).
    #[serde(with = "humantime_serde")]
    pub at: SystemTime,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Back {
    /// When the node was Ready on its new boot (its condition's transition).
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub at: Option<SystemTime>,
    #[serde(rename = "bootID")]
    pub boot_id: String,
}

/// The object's name: node, boot and episode, so that any replica names an
/// episode alike (at most 253 characters: a long node name is cut). The
/// boot is the first 8 digits of a boot ID as the kernel makes them (a
/// random UUID), or else 8 hex digits of a hash of the whole ID: IDs that
/// share their start must not share an entry.
pub fn name(node: &str, boot_id: &str, episode: u32) -> String {
    let uuid = boot_id.len() == 36
        && boot_id.chars().enumerate().all(|(i, c)| {
            matches!(i, 8 | 13 | 18 | 23) == (c == '-') && (c == '-' || c.is_ascii_hexdigit())
        });
    let boot = if uuid {
        boot_id[..8].to_ascii_lowercase()
    } else {
        // FNV-1a, folded to 32 bits.
        let h = boot_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        format!("{:08x}", (h ^ (h >> 32)) as u32)
    };
    let tail = format!(".{boot}.{episode}");
    let keep = node.len().min(253 - tail.len());
    let mut head = node[..keep].to_string();
    while head.ends_with(['.', '-']) {
        head.pop();
    }
    format!("{head}{tail}")
}

/// The ledger's entries `node` tells of: its record's episode and an
/// unannounced end its agent reported.
pub fn entries(node: &Node) -> impl Iterator<Item = (String, Spec)> {
    entry(node).into_iter().chain(unannounced(node))
}

/// The entry of a boot that ended unannounced, as its next boot's agent said
/// on the Node (episode 0). Not when it names the boot the node is on, or
/// the boot its record is of (the agent's audit lost, the cluster knows).
pub fn unannounced(node: &Node) -> Option<(String, Spec)> {
    let u = record::unannounced_of(node)?;
    let now_boot = rule::boot_id(node)?;
    let recorded = matches!(record::of_node(node), Some(Ok(r)) if r.boot_id == u.boot_id);
    if now_boot == u.boot_id || recorded {
        return None;
    }
    let spec = Spec {
        node: node.name_any(),
        boot_id: u.boot_id.clone(),
        episode: 0,
        kind: Kind::Unknown,
        path: Path::Unannounced,
        graceful: false,
        forced: false,
        opened_at: u.last_seen.unwrap_or(u.reported_at),
        ending: Ending::Unannounced,
        delivered_late: false,
        agent_claims: Claims {
            source: Some("after-boot-report".into()),
            ..Claims::default()
        },
        down: None,
        fence: None,
        back: Some(Back {
            at: Some(u.reported_at),
            boot_id: now_boot.to_string(),
        }),
        closed: None,
    };
    Some((name(&spec.node, &u.boot_id, 0), spec))
}

/// The ledger's entry for the episode `node`'s record holds, if any: its
/// object name and spec, from the Node alone.
pub fn entry(node: &Node) -> Option<(String, Spec)> {
    let rec: ShutdownRecord = record::of_node(node)?.ok()?;
    let ep = rec.episode.as_ref()?;
    let now_boot = rule::boot_id(node);
    let fence = (rule::fenced_by_us(node)
        && node.annotations().get(FENCED_BOOT_ANNOTATION) == Some(&rec.boot_id))
    .then(|| rule::fenced_at(node).map(|at| Fence { at }))
    .flatten();
    let ready = rule::ready_condition(node).filter(|c| c.status == "True");
    let back = now_boot
        .filter(|b| *b != rec.boot_id)
        .zip(ready)
        .map(|(b, c)| Back {
            at: c
                .last_transition_time
                .as_ref()
                .map(|t| SystemTime::from(t.0)),
            boot_id: b.to_string(),
        });
    let down = ep.death.as_ref().map(|d| Down {
        proof: d.proof,
        at: d.at,
        by: d.by.clone(),
    });
    let ending = match (&rec.closed, &back, &fence, &down) {
        (Some(c), _, _, _) => closing(c.how),
        (None, Some(_), _, _) => Ending::Back,
        (None, None, Some(_), _) => Ending::Fenced,
        (None, None, None, Some(_)) => Ending::Down,
        (None, None, None, None) => Ending::Open,
    };
    let mut spec = Spec {
        node: node.name_any(),
        boot_id: rec.boot_id.clone(),
        episode: ep.id,
        kind: rec.kind(),
        path: ep.path.into(),
        graceful: ep.path == ShutdownPath::Graceful,
        forced: ep.forced,
        opened_at: ep
            .timeline
            .first()
            .map(|t| t.at)
            .or(rec.at)
            .unwrap_or(SystemTime::UNIX_EPOCH),
        ending,
        delivered_late: rec.delivered_late,
        agent_claims: Claims {
            source: rec.signal.as_ref().map(|s| s.source.to_string()),
            actor: rec.signal.as_ref().and_then(|s| s.actor.clone()),
            timeline: ep.timeline.clone(),
            drain: None,
        },
        down,
        fence,
        back,
        closed: rec.closed.clone(),
    };
    spec.agent_claims.drain = drain(node, spec.opened_at);
    Some((name(&spec.node, &rec.boot_id, ep.id), spec))
}

fn closing(how: Closing) -> Ending {
    match how {
        Closing::Cancelled => Ending::Cancelled,
        Closing::Abandoned => Ending::Abandoned,
        Closing::Expired => Ending::Expired,
        Closing::Failed => Ending::Failed,
        Closing::Back => Ending::Back,
    }
}

/// What the ledger already holds stays: the fence and the proof of an
/// episode are kept once seen (the Node loses its fence when it comes back),
/// and a fenced episode that came back still says it was fenced in `fence`.
pub fn merge(old: &Spec, mut new: Spec) -> Spec {
    if new.fence.is_none() {
        new.fence = old.fence.clone();
    }
    if new.down.is_none() {
        new.down = old.down.clone();
    }
    if new.back.is_none() {
        new.back = old.back.clone();
    }
    if let Some(was) = &old.agent_claims.drain {
        let now = new.agent_claims.drain.get_or_insert_with(Drain::default);
        now.started = now.started.or(was.started);
        if now.ended.is_none() {
            now.ended = was.ended;
            now.drained = was.drained;
            now.note.clone_from(&was.note);
        }
    }
    if new.ending == Ending::Open || (new.ending == Ending::Down && old.ending != Ending::Open) {
        new.ending = old.ending;
    }
    new
}

/// `lastgasp history --cluster`: the ledger's entries opened since `since`,
/// in counts (by kind, path, ending, the agent's claimed caller), then the
/// slowest fences after the proof and the slowest drains, as text.
pub fn summary(entries: &[(String, Spec)], since: SystemTime) -> String {
    use std::{collections::BTreeMap, fmt::Write};
    let recent: Vec<&(String, Spec)> = entries
        .iter()
        .filter(|(_, s)| s.opened_at >= since)
        .collect();
    let mut out = format!(
        "{} shutdown episodes since {}\n",
        recent.len(),
        humantime::format_rfc3339_seconds(since)
    );
    let count = |key: &dyn Fn(&Spec) -> String| {
        let mut m: BTreeMap<String, usize> = BTreeMap::new();
        for (_, s) in &recent {
            *m.entry(key(s)).or_default() += 1;
        }
        let mut v: Vec<(String, usize)> = m.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v.iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (i, label) in [(0, "kind:  "), (1, "path:  "), (2, "ending:")] {
        let _ = writeln!(out, "  by {label} {}", count(&|s| s.facets()[i].1.clone()));
    }
    let _ = writeln!(
        out,
        "  by caller (the agents' claim): {}",
        count(&|s| s
            .agent_claims
            .actor
            .as_ref()
            .map_or("-".into(), |a| a.comm.clone()))
    );
    slowest(&recent, &mut out);
    let lost: Vec<&str> = recent
        .iter()
        .filter(|(_, s)| s.ending == Ending::Unannounced)
        .map(|(name, _)| name.as_str())
        .collect();
    if !lost.is_empty() {
        let _ = writeln!(
            out,
            "  unannounced boots ({}): {}",
            lost.len(),
            lost.join(", ")
        );
    }
    out
}

/// The summary's slowest fences after the proof and slowest drains.
fn slowest(recent: &[&(String, Spec)], out: &mut String) {
    use std::fmt::Write;
    let mut slow: Vec<(std::time::Duration, &str)> = recent
        .iter()
        .filter_map(|(name, s)| {
            let d = s
                .fence
                .as_ref()?
                .at
                .duration_since(s.down.as_ref()?.at)
                .ok()?;
            Some((d, name.as_str()))
        })
        .collect();
    slow.sort_by_key(|s| std::cmp::Reverse(s.0));
    if !slow.is_empty() {
        let _ = writeln!(out, "  slowest fences after the proof:");
        for (d, name) in slow.iter().take(5) {
            let _ = writeln!(out, "    {name}: {:.1} s", d.as_secs_f64());
        }
    }
    let mut drains: Vec<(std::time::Duration, &str, &Drain)> = recent
        .iter()
        .filter_map(|(name, s)| {
            let d = s.agent_claims.drain.as_ref()?;
            Some((d.took()?, name.as_str(), d))
        })
        .collect();
    drains.sort_by_key(|d| std::cmp::Reverse(d.0));
    if !drains.is_empty() {
        let _ = writeln!(out, "  slowest drains (the agents' word):");
        for (took, name, d) in drains.iter().take(5) {
            let _ = write!(out, "    {name}: {:.1} s", took.as_secs_f64());
            if let Some(n) = &d.note {
                let _ = write!(out, ", {} pods gone, {} left", n.gone, n.left);
                if let Some(p) = &n.slowest {
                    let _ = write!(out, ", slowest {} {:.1} s", p.pod, p.seconds);
                }
            }
            let _ = writeln!(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::{FENCE_MANAGER, TAINTED_BY_ANNOTATION};

    const RECORD: &str = r#"{"v":2,"boot_id":"b1","at":"2026-11-28T07:00:00Z",
        "episode":{"id":1,"kind":"poweroff","path":"immediate","forced":true,"protected":false,"deadline":null,
          "timeline":[{"at":"2026-11-28T07:00:00Z","source":"reboot-syscall","kind":"poweroff","summary":"reboot(2)"}],
          "death":{"proof":"kernel","at":"2026-11-28T07:00:01Z","by":"reboot(2) by PID 1"}},
        "signal":{"source":"reboot-syscall","kind":"poweroff","forced":true,"scope":"node","at":"2026-11-28T07:00:00Z",
          "actor":{"pid":1,"comm":"systemd-shutdow","uid":0}}}"#;

    /// Node `n1` on boot `boot` (Ready since 07:05), carrying `RECORD`;
    /// `fenced`: this controller's taint and annotations, written at 07:00:05.
    fn node(boot: &str, fenced: bool) -> Node {
        let mut annotations = serde_json::json!({ record::RECORD_ANNOTATION: RECORD });
        let mut taints = serde_json::json!([]);
        let mut managed = serde_json::json!([]);
        if fenced {
            annotations[TAINTED_BY_ANNOTATION] = "lastgasp-controller".into();
            annotations[FENCED_BOOT_ANNOTATION] = "b1".into();
            taints = serde_json::json!([{"key": super::super::OUT_OF_SERVICE_KEY, "value": "nodeshutdown", "effect": "NoExecute"}]);
            managed = serde_json::json!([{"manager": FENCE_MANAGER, "operation": "Apply", "time": "2026-11-28T07:00:05Z"}]);
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "annotations": annotations, "managedFields": managed},
            "spec": {"taints": taints},
            "status": {"nodeInfo": {"bootID": boot, "machineID": "", "systemUUID": "", "kernelVersion": "",
                "osImage": "", "containerRuntimeVersion": "", "kubeletVersion": "", "kubeProxyVersion": "",
                "operatingSystem": "linux", "architecture": "amd64"},
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-28T07:05:00Z"}]}
        }))
        .unwrap()
    }

    fn at(s: &str) -> SystemTime {
        humantime::parse_rfc3339(s).unwrap()
    }

    #[test]
    fn an_episode_reads_down_then_fenced_then_back_and_keeps_its_fence() {
        let (name, down) = entry(&node("b1", false)).unwrap();
        assert_eq!(name, super::name("n1", "b1", 1));
        assert_eq!(down.ending, Ending::Down);
        assert_eq!(down.down.as_ref().map(|d| d.proof), Some(Proof::Kernel));
        assert_eq!(
            down.agent_claims.actor.as_ref().map(|a| a.comm.as_str()),
            Some("systemd-shutdow")
        );
        assert_eq!(down.agent_claims.source.as_deref(), Some("reboot-syscall"));
        assert_eq!(down.opened_at, at("2026-11-28T07:00:00Z"));
        assert!(!down.graceful && down.forced);

        let (_, fenced) = entry(&node("b1", true)).unwrap();
        assert_eq!(fenced.ending, Ending::Fenced);
        assert_eq!(
            fenced.fence,
            Some(Fence {
                at: at("2026-11-28T07:00:05Z")
            })
        );

        // Back on a new boot: the controller lifted its fence, the Node no
        // longer shows it; the ledger keeps it.
        let (_, back) = entry(&node("b2", false)).unwrap();
        assert_eq!(back.ending, Ending::Back);
        assert_eq!(back.fence, None);
        let kept = merge(&fenced, back);
        assert_eq!(kept.ending, Ending::Back);
        assert_eq!(kept.fence, fenced.fence);
        assert_eq!(
            kept.back,
            Some(Back {
                at: Some(at("2026-11-28T07:05:00Z")),
                boot_id: "b2".into()
            })
        );
        // The spec as the CRD's schema names it.
        let text = summary(&[(name.clone(), kept.clone())], at("2026-11-27T00:00:00Z"));
        assert!(
            text.starts_with("1 shutdown episodes since 2026-11-27T00:00:00Z"),
            "{text}"
        );
        assert!(text.contains("by kind:   poweroff 1"), "{text}");
        assert!(text.contains("by ending: back 1"), "{text}");
        assert!(
            text.contains("(the agents' claim): systemd-shutdow 1"),
            "{text}"
        );
        assert!(text.contains(&format!("{name}: 4.0 s")), "{text}");
        let json = serde_json::to_value(&kept).unwrap();
        for key in [
            "node",
            "bootID",
            "episode",
            "kind",
            "path",
            "openedAt",
            "ending",
            "agentClaims",
            "fence",
            "back",
        ] {
            assert!(json.get(key).is_some(), "{key} missing: {json}");
        }
    }

    /// `node` with the agent's drain conditions: `DrainInProgress` (status,
    /// at) and `Drained` (status, at, message).
    fn with_drain(mut n: Node, going: (&str, &str), done: (&str, &str, &str)) -> Node {
        let conds = n.status.as_mut().unwrap().conditions.as_mut().unwrap();
        for c in [
            serde_json::json!({"type": DRAIN_IN_PROGRESS, "status": going.0, "lastTransitionTime": going.1}),
            serde_json::json!({"type": DRAINED, "status": done.0, "lastTransitionTime": done.1,
                "message": done.2}),
        ] {
            conds.push(serde_json::from_value(c).unwrap());
        }
        n
    }

    #[test]
    fn the_drain_is_the_agents_conditions_since_the_episode_opened() {
        let note = "graceful shutdown done: 3 pods terminated, 1 still running; slowest default/slow-0 20.3 s";
        // In progress (seen by one round), then done: the start is kept.
        let going = with_drain(
            node("b1", false),
            ("True", "2026-11-28T07:00:00Z"),
            ("False", "2026-11-28T06:00:00Z", "an older drain"),
        );
        let (_, first) = entry(&going).unwrap();
        let d = first.agent_claims.drain.clone().unwrap();
        assert_eq!(d.started, Some(at("2026-11-28T07:00:00Z")));
        assert_eq!((d.ended, d.drained, d.note), (None, None, None));
        let done = with_drain(
            node("b1", false),
            ("False", "2026-11-28T07:00:25Z"),
            ("False", "2026-11-28T07:00:25Z", note),
        );
        let (name, then) = entry(&done).unwrap();
        let kept = merge(&first, then);
        let d = kept.agent_claims.drain.clone().unwrap();
        assert_eq!(d.started, Some(at("2026-11-28T07:00:00Z")));
        assert_eq!(d.ended, Some(at("2026-11-28T07:00:25Z")));
        assert_eq!(d.drained, Some(false));
        assert_eq!(d.note, record::DrainNote::parse(note));
        assert_eq!(d.took(), Some(std::time::Duration::from_secs(25)));
        let json = serde_json::to_value(&kept).unwrap();
        assert_eq!(json["agentClaims"]["drain"]["gone"], 3, "{json}");
        assert_eq!(
            json["agentClaims"]["drain"]["slowest"]["pod"],
            "default/slow-0"
        );
        let text = summary(&[(name.clone(), kept)], at("2026-11-27T00:00:00Z"));
        assert!(
            text.contains(&format!(
                "{name}: 25.0 s, 3 pods gone, 1 left, slowest default/slow-0 20.3 s"
            )),
            "{text}"
        );
        // Conditions of an earlier episode, or cleared on the way back, are
        // not this episode's drain.
        for (going, done) in [
            (
                ("True", "2026-11-28T06:00:00Z"),
                ("True", "2026-11-28T06:00:09Z", note),
            ),
            (
                ("False", "2026-11-28T07:05:00Z"),
                ("False", "2026-11-28T07:05:00Z", "back"),
            ),
        ] {
            let (_, e) = entry(&with_drain(node("b1", false), going, done)).unwrap();
            assert_eq!(e.agent_claims.drain, None, "{going:?} {done:?}");
        }
    }

    #[test]
    fn an_unannounced_end_is_its_own_entry_and_only_of_an_earlier_boot() {
        let mut n = node("b3", false);
        let said = |boot: &str| {
            serde_json::json!({"bootID": boot, "lastSeen": "2026-11-28T08:00:00Z",
                "reportedAt": "2026-11-28T09:00:00Z"})
            .to_string()
        };
        n.annotations_mut()
            .insert(record::UNANNOUNCED_ANNOTATION.into(), said("b2"));
        let all: Vec<_> = entries(&n).collect();
        assert_eq!(all.len(), 2, "the record's episode and the unannounced end");
        let (name, u) = &all[1];
        assert_eq!(*name, super::name("n1", "b2", 0));
        assert_eq!(
            (u.ending, u.path, u.kind),
            (Ending::Unannounced, Path::Unannounced, Kind::Unknown)
        );
        assert_eq!(u.opened_at, at("2026-11-28T08:00:00Z"), "last seen alive");
        assert_eq!(
            u.back,
            Some(Back {
                at: Some(at("2026-11-28T09:00:00Z")),
                boot_id: "b3".into()
            })
        );
        // Not of the boot the node is on, nor of the boot its record is of;
        // an unreadable annotation is no entry.
        for (boot, claim) in [("b3", said("b3")), ("b3", said("b1")), ("b3", "{".into())] {
            let mut n = node(boot, false);
            n.annotations_mut()
                .insert(record::UNANNOUNCED_ANNOTATION.into(), claim.clone());
            assert!(unannounced(&n).is_none(), "{claim}");
        }
        let text = summary(&all, at("2026-11-27T00:00:00Z"));
        assert!(
            text.contains(&format!("unannounced boots (1): {name}")),
            "{text}"
        );
    }

    #[test]
    fn names_are_the_episode_and_fit() {
        assert_eq!(
            name("worker-3", "5F0C2A1B-77aa-4e2b-9c1d-0123456789ab", 2),
            "worker-3.5f0c2a1b.2"
        );
        let long = "n".repeat(260);
        let n = name(&long, "5f0c2a1b-77aa-4e2b-9c1d-0123456789ab", 1);
        assert!(n.len() <= 253, "{}", n.len());
        assert!(n.ends_with(".5f0c2a1b.1"));
        // Not a UUID: a hash of the whole ID, so a shared start is no clash.
        let (a, b) = (name("n", "boot-n-0001", 1), name("n", "boot-n-0002", 1));
        assert_ne!(a, b);
        assert_eq!(a.len(), "n.".len() + 8 + ".1".len(), "{a}");
    }
}
