//! The shutdown record on the Node: its types are the contract in
//! `lastgasp_common::wire::record` (the annotation names in
//! `lastgasp_common::names`); here, reading it off a Node and the
//! API server's time of its write.
use std::time::{Duration, SystemTime};

pub use lastgasp_common::{
    names::{PROOF_ANNOTATION, RECORD_ANNOTATION, RECORD_MANAGER, UNANNOUNCED_ANNOTATION},
    wire::record::*,
};

/// How far a record's own time may run ahead of the API server's time of
/// its write before it counts as no evidence (clock skew).
pub const MAX_SKEW: Duration = Duration::from_secs(5);

/// The record annotation of `node`, if any; `Err` when it is there and
/// unreadable.
pub fn of_node(node: &k8s_openapi::api::core::v1::Node) -> Option<Result<ShutdownRecord, String>> {
    node.metadata
        .annotations
        .as_ref()?
        .get(RECORD_ANNOTATION)
        .map(|raw| ShutdownRecord::parse(raw))
}

/// The unannounced end `node` carries, if readable.
pub fn unannounced_of(node: &k8s_openapi::api::core::v1::Node) -> Option<UnannouncedEnd> {
    let raw = node
        .metadata
        .annotations
        .as_ref()?
        .get(UNANNOUNCED_ANNOTATION)?;
    serde_json::from_str(raw).ok()
}

/// The API server's time of the last write of the record on `node` (whole
/// seconds): the `managedFields` entry of [`RECORD_MANAGER`].
pub fn written_at(node: &k8s_openapi::api::core::v1::Node) -> Option<SystemTime> {
    managed_time(&node.metadata, RECORD_MANAGER)
}

/// The newest `managedFields` time of `manager` on the object itself (not a
/// subresource): the API server stamps it when that manager's request
/// changed something.
pub fn managed_time(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    manager: &str,
) -> Option<SystemTime> {
    meta.managed_fields
        .iter()
        .flatten()
        .filter(|m| m.manager.as_deref() == Some(manager))
        .filter(|m| m.subresource.as_deref().unwrap_or("").is_empty())
        .filter_map(|m| m.time.as_ref())
        .map(|t| SystemTime::from(t.0))
        .max()
}

/// The record the agent writes in `boot_id` after `signals` (for tests):
/// the episode they open, from the decision core, with the proof the last
/// one carries.
#[cfg(any(test, feature = "fixtures"))]
pub fn after(boot_id: &str, signals: &[crate::signal::ShutdownSignal]) -> ShutdownRecord {
    let mut d = crate::decide::Decider::new();
    let ep = signals
        .iter()
        .filter_map(|s| d.decide(s).episode)
        .last()
        .expect("the signals open an episode");
    ShutdownRecord::new(boot_id, signals.last().expect("a signal"), &ep)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_drain_note_reads_back_as_written() {
        let full = DrainNote {
            gone: 4,
            left: 1,
            slowest: Some(SlowPod {
                pod: "default/slow 0".into(),
                seconds: 20.3,
            }),
        };
        let text = full.to_string();
        assert_eq!(
            text,
            "graceful shutdown done: 4 pods terminated, 1 still running; slowest default/slow 0 20.3 s"
        );
        assert_eq!(DrainNote::parse(&text), Some(full));
        let bare = DrainNote::default();
        assert_eq!(DrainNote::parse(&bare.to_string()), Some(bare));
        for other in [
            "",
            "graceful shutdown done: four pods terminated, 0 still running",
            "graceful shutdown done: 1 pods terminated, 0 still running; slowest x",
            "the kubelet's own message",
        ] {
            assert_eq!(DrainNote::parse(other), None, "{other}");
        }
    }
    use crate::{
        decide::{Decider, Proof},
        signal::{Kind, ShutdownSignal, Source},
    };

    fn reboot2() -> ShutdownSignal {
        ShutdownSignal::of(Source::RebootSyscall, Kind::Poweroff)
            .at(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000))
            .boot_ns(5)
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let s = reboot2();
        let ep = Decider::new().decide(&s).episode.unwrap();
        let r = ShutdownRecord::new("b1", &s, &ep);
        let back = ShutdownRecord::parse(&r.to_json()).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.v, VERSION);
        assert_eq!(back.kind(), Kind::Poweroff);
        assert!(back.closed.is_none());
        // The raw detail and the boot clock stay in the audit log.
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert!(v["signal"].get("detail").is_none() && v["signal"].get("boot_ns").is_none());
        let closed = r.closed(Closing::Cancelled, "logind said false", SystemTime::now());
        let back = ShutdownRecord::parse(&closed.to_json()).unwrap();
        assert_eq!(back.closed.unwrap().how, Closing::Cancelled);
    }

    /// Version 1 (older agents): `back` and `abandoned` close it, and only
    /// the kernel's own signals prove death.
    #[test]
    fn version_1_records_are_read() {
        let v1 = |source: &str, extra: serde_json::Value| {
            let mut r = json!({"boot_id": "b", "at": "2026-11-25T00:00:00Z",
                "episode": {"id": 1, "kind": "unknown", "path": "immediate", "timeline": [],
                    "deadline": null, "protected": false, "forced": true},
                "signal": {"source": source, "kind": "poweroff", "forced": true, "scope": "node",
                    "effect": "now", "at": "2026-11-25T00:00:00Z", "actor": {"pid": 7, "comm": "x", "uid": 0}}});
            for (k, v) in extra.as_object().unwrap() {
                r[k] = v.clone();
            }
            ShutdownRecord::parse(&r.to_string()).unwrap()
        };
        let r = v1("reboot-syscall", json!({}));
        assert_eq!(r.v, 1);
        assert_eq!(
            r.kind(),
            Kind::Poweroff,
            "the signal's kind where the episode has none"
        );
        assert_eq!(r.death().map(|d| d.proof), Some(Proof::Kernel));
        assert_eq!(v1("exec", json!({})).death(), None);
        assert_eq!(v1("logind", json!({})).death(), None);
        let back = v1("reboot-syscall", json!({"back": true}));
        assert_eq!(back.closed.map(|c| c.how), Some(Closing::Back));
        let ab = v1(
            "exec",
            json!({"abandoned": true, "abandoned_why": "no shutdown came"}),
        );
        assert_eq!(ab.closed.as_ref().map(|c| c.how), Some(Closing::Abandoned));
        assert_eq!(ab.closed.unwrap().why, "no shutdown came");
        // Closed in v1 terms is not written back in them.
        assert!(!ab_json_has_v1_flags(&v1("exec", json!({"back": true}))));
    }

    fn ab_json_has_v1_flags(r: &ShutdownRecord) -> bool {
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        v.get("back").is_some() || v.get("abandoned").is_some()
    }

    #[test]
    fn bad_annotations_say_why() {
        assert!(ShutdownRecord::parse("{}").unwrap_err().contains("boot_id"));
        assert!(ShutdownRecord::parse("nope").is_err());
        let future = json!({"v": 99, "boot_id": "b"}).to_string();
        assert!(ShutdownRecord::parse(&future)
            .unwrap_err()
            .contains("newer"));
    }
}
