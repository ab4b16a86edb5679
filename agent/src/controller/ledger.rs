//! The fleet's shutdown ledger: one `NodeShutdown` (`lastgasp.dev/v1alpha1`,
//! cluster-scoped, `deploy/kustomize/nodeshutdown-crd.yaml`) per shutdown
//! episode of a node, written by the controller alone from what the API
//! server holds: the node's record (its episode, proof and close), this
//! controller's fence and the node's return on a new boot. [`entry`] reads a
//! Node; [`merge`] keeps what the Node no longer shows (a fence lifted when
//! the node came back). What the agent says of the caller stays the agent's
//! claim (`agentClaims`).
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use serde::{Deserialize, Serialize};

use super::{rule, FENCED_BOOT_ANNOTATION};
use crate::{
    decide::{Proof, ShutdownPath, TimelineEntry},
    record::{self, ActorSummary, Closed, Closing, ShutdownRecord},
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
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub node: String,
    #[serde(rename = "bootID")]
    pub boot_id: String,
    pub episode: u32,
    pub kind: Kind,
    pub path: ShutdownPath,
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
/// episode alike (at most 253 characters: a long node name is cut).
pub fn name(node: &str, boot_id: &str, episode: u32) -> String {
    let boot: String = boot_id
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(8)
        .collect::<String>()
        .to_ascii_lowercase();
    let tail = format!(".{boot}.{episode}");
    let keep = node.len().min(253 - tail.len());
    let mut head = node[..keep].to_string();
    while head.ends_with(['.', '-']) {
        head.pop();
    }
    format!("{head}{tail}")
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
    let spec = Spec {
        node: node.name_any(),
        boot_id: rec.boot_id.clone(),
        episode: ep.id,
        kind: ep.kind,
        path: ep.path,
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
        },
        down,
        fence,
        back,
        closed: rec.closed.clone(),
    };
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
    if new.ending == Ending::Open || (new.ending == Ending::Down && old.ending != Ending::Open) {
        new.ending = old.ending;
    }
    new
}

/// `lastgasp history --cluster`: the ledger's entries opened since `since`,
/// in counts (by kind, path, ending, the agent's claimed caller), then the
/// slowest fences after the proof, as text.
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
    let word = |v: serde_json::Value| v.as_str().unwrap_or("?").to_string();
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
    let _ = writeln!(
        out,
        "  by kind:   {}",
        count(&|s| word(serde_json::json!(s.kind)))
    );
    let _ = writeln!(
        out,
        "  by path:   {}",
        count(&|s| word(serde_json::json!(s.path)))
    );
    let _ = writeln!(
        out,
        "  by ending: {}",
        count(&|s| word(serde_json::json!(s.ending)))
    );
    let _ = writeln!(
        out,
        "  by caller (the agents' claim): {}",
        count(&|s| s
            .agent_claims
            .actor
            .as_ref()
            .map_or("-".into(), |a| a.comm.clone()))
    );
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
    out
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
        assert_eq!(name, "n1.b1.1");
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
        let text = summary(
            &[("n1.b1.1".into(), kept.clone())],
            at("2026-11-27T00:00:00Z"),
        );
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
        assert!(text.contains("n1.b1.1: 4.0 s"), "{text}");
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

    #[test]
    fn names_are_the_episode_and_fit() {
        assert_eq!(
            name("worker-3", "5F0C2A1B-77aa-4e2b-9c1d-0123456789ab", 2),
            "worker-3.5f0c2a1b.2"
        );
        let long = "n".repeat(260);
        let n = name(&long, "abcdef0123", 1);
        assert!(n.len() <= 253, "{}", n.len());
        assert!(n.ends_with(".abcdef01.1"));
    }
}
