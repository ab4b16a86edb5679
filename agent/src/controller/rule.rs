//! The verdict on one node: pure, from what the API server stores alone
//! (the Node with its record and `managedFields`, the kubelet's Lease, the
//! server's own time), so that any replica, started now or long ago,
//! reaches the same one.
//!
//! A node is fenced only on proof that its kernel went down
//! ([`crate::decide::Proof`]), in a record that is current: of the node's
//! present boot, not closed, not written ahead of the server's time, newer
//! than the node's last Ready, and not contradicted by its kubelet writing
//! its Lease after the proof was written. Then:
//! - the kernel's own power-off: fenced once the proof has stood for the
//!   quiet time, so that a reboot(2) that returned can be retracted first;
//! - a direct tool (`poweroff -f`): fenced once the proof has stood for
//!   its own quiet time (longer than the agent keeps a proof whose
//!   reboot(2) never comes, so that its withdrawal lands first) and the
//!   kubelet's Lease is silent past its renew interval and the margin,
//!   since nothing stops the kubelet before the tool's own reboot(2).
//!
//! Every time compared is the API server's own stamp: the record's write
//! and the kubelet's (its Lease, its Ready), the server's `Date`.
//!
//! A record without proof (a graceful shutdown, or one through PID 1, which
//! stops or kills every process and waits for each) fences nothing until
//! the agent's last word: the kernel's reboot(2) at its very end.
use std::time::{Duration, SystemTime};

use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{Node, NodeCondition},
};
use kube::ResourceExt;

use super::{
    ControllerConfig, FencePolicy, FENCED_BOOT_ANNOTATION, FENCED_CONDITION, FENCE_MANAGER,
    OUT_OF_SERVICE_KEY, TAINTED_BY_ANNOTATION,
};
use crate::{
    decide::Proof,
    record::{self, managed_time, ShutdownRecord, MAX_SKEW, PROOF_ANNOTATION},
    signal::{Kind, Source},
};

/// Server stamps (`managedFields[].time`, the `Date` header) are whole
/// seconds: a time read as `t` is in `[t, t + 1 s)`.
const STAMP: Duration = Duration::from_secs(1);

/// lastgasp's final unit speaks before systemd-shutdown: its kill sweep
/// (up to its 90 s timeout), the unmount loop, then reboot(2). Measured
/// 2.9 s under TCG with a busy mount, more than the proof's quiet: its
/// word is fenced only once that sweep's bound has passed. The agent's
/// word at the sweep's end (`final-sweep`) waits as long: the unmount
/// loop, bounded by nothing shorter, is still to come.
pub const FINAL_UNIT_SETTLE: Duration = Duration::from_secs(100);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Taint the node, then delete with grace 0 the pods the taint evicts.
    Fence { why: String },
    /// A current record with a proof; not yet enough (the quiet time, or the
    /// kubelet's silence, is still to come).
    Wait { why: String },
    /// A current record with a proof, but the kubelet wrote its Lease after
    /// the proof was written: the node lived on. Not fenced on that record.
    Contradicted { why: String },
    /// Ours, and Ready again on a new boot: the taint goes.
    Untaint,
    /// Ours, on the boot it was fenced in, and alive again: it never went
    /// down. The taint stays for a human (its volumes may have moved).
    BackOnSameBoot,
    /// Ours, and still down.
    Fenced,
    /// Nothing to do; `why`, where a record was read and not acted on.
    Nothing { why: String },
}

impl Verdict {
    /// The variant's name, without its reason.
    pub fn kind(&self) -> &'static str {
        match self {
            Verdict::Fence { .. } => "Fence",
            Verdict::Wait { .. } => "Wait",
            Verdict::Contradicted { .. } => "Contradicted",
            Verdict::Untaint => "Untaint",
            Verdict::BackOnSameBoot => "BackOnSameBoot",
            Verdict::Fenced => "Fenced",
            Verdict::Nothing { .. } => "Nothing",
        }
    }

    fn nothing(why: impl Into<String>) -> Self {
        Verdict::Nothing { why: why.into() }
    }
}

/// The kubelet's Ready condition, if reported.
pub(super) fn ready_condition(node: &Node) -> Option<&NodeCondition> {
    condition(node, "Ready")
}

/// The Node's condition of `type_`.
pub(super) fn condition<'a>(node: &'a Node, type_: &str) -> Option<&'a NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
}

/// While Ready is True: the API server's time of the last write of the
/// manager that owns the Ready condition (the kubelet saying it is Ready).
/// The condition's own times are the kubelet's clock, and are not used.
pub fn ready_written(node: &Node) -> Option<SystemTime> {
    ready_condition(node).filter(|c| c.status == "True")?;
    node.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.fields_v1.as_ref().is_some_and(|f| {
                f.0.pointer("/f:status/f:conditions")
                    .and_then(|c| c.get(r#"k:{"type":"Ready"}"#))
                    .is_some()
            })
        })
        .filter_map(|m| m.time.as_ref())
        .map(|t| SystemTime::from(t.0))
        .max()
}

pub fn boot_id(node: &Node) -> Option<&str> {
    node.status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|i| i.boot_id.as_str())
        .filter(|b| !b.is_empty())
}

pub fn has_out_of_service(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE_KEY))
}

/// The node carries the out-of-service taint, put there by this controller.
pub fn fenced_by_us(node: &Node) -> bool {
    has_out_of_service(node) && node.annotations().contains_key(TAINTED_BY_ANNOTATION)
}

/// The API server's time of the controller's last write of the Node: when
/// it fenced it (whole seconds).
pub(super) fn fenced_at(node: &Node) -> Option<SystemTime> {
    managed_time(&node.metadata, FENCE_MANAGER)
}

/// What a node's kubelet Lease says, on the API server's clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Liveness {
    /// The Lease's last write (the newest `managedFields` time of any
    /// manager: the server stamps it).
    pub written: SystemTime,
    /// Silent for at least this long at the time asked (counted so that it
    /// can only be late: both stamps are whole seconds).
    pub silent: Duration,
    /// The kubelet's renew interval (a quarter of `leaseDurationSeconds`).
    pub interval: Duration,
}

/// The Lease at server time `now`, or why it says nothing. The kubelet's
/// own `renewTime` is its clock, not the server's, and is not used.
pub fn liveness(lease: &Lease, now: SystemTime) -> Result<Liveness, String> {
    let written = lease
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.time.as_ref())
        .map(|t| SystemTime::from(t.0))
        .max()
        .ok_or("the Lease carries no server time (managedFields)")?;
    let secs = lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_duration_seconds)
        .filter(|d| *d > 0)
        .ok_or("the Lease has no leaseDurationSeconds")?;
    Ok(Liveness {
        written,
        silent: now
            .duration_since(written)
            .unwrap_or_default()
            .saturating_sub(STAMP),
        interval: Duration::from_secs(u64::from(secs.unsigned_abs())) / 4,
    })
}

/// Whether stamp `a` is certainly later than stamp `b` (whole seconds).
fn certainly_after(a: SystemTime, b: SystemTime) -> bool {
    a >= b + STAMP
}

/// The verdict on `node` at server time `now`, with its kubelet's `lease`
/// as read with `now`.
pub fn judge(
    node: &Node,
    lease: Option<&Lease>,
    now: SystemTime,
    cfg: &ControllerConfig,
) -> Verdict {
    if has_out_of_service(node) {
        return judge_fenced(node, lease, now);
    }
    if cfg.policy == FencePolicy::Off {
        return Verdict::nothing("");
    }
    let rec = match record::of_node(node) {
        None => return Verdict::nothing(""),
        Some(Err(e)) => return Verdict::nothing(e),
        Some(Ok(r)) => r,
    };
    match evidence(node, &rec, now, cfg) {
        Err(why) => Verdict::nothing(why),
        Ok(ev) if lifted_by_hand(node, &ev) => Verdict::nothing(format!(
            "{}; this controller fenced the node on it, and its taint was removed by hand: not again on this record",
            ev.what
        )),
        Ok(ev) => weigh(&ev, lease, now, cfg),
    }
}

/// This controller fenced the node in its present boot on this record
/// (its annotations stay), and someone removed the taint since.
fn lifted_by_hand(node: &Node, ev: &Evidence) -> bool {
    let same_boot = matches!(node.annotations().get(FENCED_BOOT_ANNOTATION),
        Some(b) if Some(b.as_str()) == boot_id(node));
    same_boot
        && node.annotations().contains_key(TAINTED_BY_ANNOTATION)
        && fenced_at(node).is_some_and(|f| f >= ev.written)
}

/// Why the remediators' condition, True on `node`, no longer holds: this
/// controller's taint is gone (`FenceLifted`: removed by hand, by another
/// tool, or lifted), or the node runs another boot than the one fenced
/// (`NodeBack`). `None`: it holds, or it is not True.
pub fn stale_condition(node: &Node) -> Option<&'static str> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == FENCED_CONDITION && c.status == "True")?;
    if !fenced_by_us(node) {
        return Some("FenceLifted");
    }
    let same_boot = matches!(node.annotations().get(FENCED_BOOT_ANNOTATION),
        Some(b) if Some(b.as_str()) == boot_id(node));
    (!same_boot).then_some("NodeBack")
}

/// A current record's proof, and the server's time of its write.
struct Evidence {
    proof: Proof,
    /// How long its proof must stand: the quiet, and for the final unit's
    /// word systemd-shutdown's sweep too.
    quiet: Duration,
    written: SystemTime,
    what: String,
    /// The server's time of the kubelet's last Ready status write.
    ready: Option<SystemTime>,
}

/// The record's proof, if the record is current; else why it is no evidence.
fn evidence(
    node: &Node,
    rec: &ShutdownRecord,
    now: SystemTime,
    cfg: &ControllerConfig,
) -> Result<Evidence, String> {
    if let Some(c) = &rec.closed {
        return Err(format!("the record is closed ({}: {})", c.how, c.why));
    }
    match boot_id(node) {
        None => return Err("the Node reports no bootID".into()),
        Some(b) if b != rec.boot_id => {
            return Err(format!(
                "the record is of boot {}, the node's is {b}",
                rec.boot_id
            ))
        }
        Some(_) => {}
    }
    let written = record::written_at(node).ok_or(
        "the API server's time of the record's write is unknown (no managedFields entry of lastgasp-record)",
    )?;
    match rec.at {
        Some(at) if at > written + MAX_SKEW => {
            return Err(format!(
                "the record's time ({}) is ahead of its write on the API server ({}): no evidence",
                humantime::format_rfc3339_seconds(at),
                humantime::format_rfc3339_seconds(written)
            ))
        }
        None => return Err("the record carries no time".into()),
        Some(_) => {}
    }
    if written > now + STAMP {
        return Err("the record was written after the server's time of this read".into());
    }
    let kind = rec.kind();
    match kind {
        Kind::Poweroff | Kind::Halt => {}
        Kind::Reboot | Kind::Kexec | Kind::SoftReboot | Kind::Unknown
            if cfg.policy == FencePolicy::AlsoReboots =>
        {
            let waited = now.duration_since(written).unwrap_or_default();
            if waited < cfg.reboot_timeout {
                return Err(format!(
                    "a {kind}: fenced only if it has not come back after {}s",
                    cfg.reboot_timeout.as_secs()
                ));
            }
        }
        _ => return Err(format!("a {kind} is not fenced (policy)")),
    }
    let death = rec.death().ok_or_else(|| {
        format!("a {kind} announced, with no proof that the kernel went down (yet)")
    })?;
    // What admission reads before it lets the taint on (an agent older than
    // the proof annotation writes none: its node is not fenced).
    let mark = node.annotations().get(PROOF_ANNOTATION);
    if mark != rec.proof_mark().as_ref() {
        return Err(format!(
            "its proof is not the one the node's agent wrote for admission ({PROOF_ANNOTATION}: {})",
            mark.map_or("none", String::as_str)
        ));
    }
    let before_unmount = rec
        .signal
        .as_ref()
        .is_some_and(|s| matches!(s.source, Source::FinalUnit | Source::FinalSweep));
    Ok(Evidence {
        quiet: if before_unmount {
            cfg.proof_quiet + FINAL_UNIT_SETTLE
        } else {
            cfg.proof_quiet
        },
        proof: death.proof,
        ready: ready_written(node),
        written,
        what: format!(
            "{kind} of boot {}: {} (written {})",
            rec.boot_id,
            death.by,
            humantime::format_rfc3339_seconds(written)
        ),
    })
}

/// A current proof against the kubelet's Lease and the time.
fn weigh(ev: &Evidence, lease: Option<&Lease>, now: SystemTime, cfg: &ControllerConfig) -> Verdict {
    // The kubelet alive after the proof, by its status or its Lease: the
    // same contradiction, whichever of its writes came first.
    if let Some(r) = ev.ready.filter(|r| certainly_after(*r, ev.written)) {
        return Verdict::Contradicted {
            why: format!(
                "{}; its kubelet said Ready after it ({})",
                ev.what,
                humantime::format_rfc3339_seconds(r)
            ),
        };
    }
    let Some(lease) = lease else {
        return Verdict::nothing(format!(
            "{}; no Lease of its kubelet to check it against",
            ev.what
        ));
    };
    let live = match liveness(lease, now) {
        Ok(l) => l,
        Err(why) => return Verdict::nothing(format!("{}; {why}", ev.what)),
    };
    if certainly_after(live.written, ev.written) {
        return Verdict::Contradicted {
            why: format!(
                "{}; its kubelet wrote its Lease after it ({})",
                ev.what,
                humantime::format_rfc3339_seconds(live.written)
            ),
        };
    }
    match ev.proof {
        Proof::Kernel | Proof::FinalStage => {
            let stood = now
                .duration_since(ev.written)
                .unwrap_or_default()
                .saturating_sub(STAMP);
            if stood >= ev.quiet {
                Verdict::Fence {
                    why: format!(
                        "{}; the kernel's power-off, {}s ago",
                        ev.what,
                        stood.as_secs()
                    ),
                }
            } else {
                Verdict::Wait {
                    why: format!("{}; quiet for {}s first", ev.what, ev.quiet.as_secs()),
                }
            }
        }
        Proof::DirectTool => {
            let stood = now
                .duration_since(ev.written)
                .unwrap_or_default()
                .saturating_sub(STAMP);
            if stood < cfg.direct_tool_quiet {
                Verdict::Wait {
                    why: format!(
                        "{}; quiet for {}s first (the tool's reboot(2) may not come)",
                        ev.what,
                        cfg.direct_tool_quiet.as_secs()
                    ),
                }
            } else if live.silent > live.interval + cfg.lease_margin {
                Verdict::Fence {
                    why: format!(
                        "{}; its kubelet's Lease unwritten for over {}s since",
                        ev.what,
                        live.silent.as_secs()
                    ),
                }
            } else {
                Verdict::Wait {
                    why: format!("{}; waiting for its kubelet's Lease to go silent", ev.what),
                }
            }
        }
    }
}

/// A node that carries the out-of-service taint.
fn judge_fenced(node: &Node, lease: Option<&Lease>, now: SystemTime) -> Verdict {
    if !fenced_by_us(node) {
        return Verdict::nothing("its out-of-service taint is not this controller's");
    }
    let same_boot = matches!(node.annotations().get(FENCED_BOOT_ANNOTATION),
        Some(b) if Some(b.as_str()) == boot_id(node));
    let ready = ready_condition(node).is_some_and(|c| c.status == "True");
    if !same_boot {
        return if ready {
            Verdict::Untaint
        } else {
            Verdict::Fenced
        };
    }
    // On the boot it was fenced in: alive again if Ready turned True after
    // the fence, or its kubelet wrote its Lease after it. A Ready from
    // before the fence is stale (the lifecycle controller takes 50 s).
    let Some(fenced) = fenced_at(node) else {
        return Verdict::Fenced;
    };
    let ready_after = ready_written(node).is_some_and(|r| r >= fenced);
    let lease_after = lease
        .and_then(|l| liveness(l, now).ok())
        .is_some_and(|l| certainly_after(l.written, fenced));
    if ready_after || lease_after {
        Verdict::BackOnSameBoot
    } else {
        Verdict::Fenced
    }
}

/// Whether the verdict on `node` can depend on its kubelet's Lease (the
/// pass reads the Leases only then).
pub fn wants_lease(node: &Node) -> bool {
    fenced_by_us(node)
        || matches!(record::of_node(node), Some(Ok(r)) if r.closed.is_none() && r.death().is_some())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::{
            coordination::v1::LeaseSpec,
            core::v1::{NodeSpec, NodeStatus, NodeSystemInfo, Taint},
        },
        apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time},
        jiff::Timestamp,
    };

    use super::*;
    use crate::{
        record::{Closing, RECORD_ANNOTATION, RECORD_MANAGER},
        signal::{Actor, Detail, ShutdownSignal, Source},
    };

    const T0: u64 = 1_800_000_000;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(T0 + s)
    }

    fn stamp(s: u64) -> Time {
        Time(Timestamp::try_from(t(s)).unwrap())
    }

    fn cfg() -> ControllerConfig {
        ControllerConfig::new("a")
    }

    fn root(pid: u32, comm: &str) -> Actor {
        Actor {
            pid,
            ns_pid: pid,
            comm: comm.into(),
            euid: Some(0),
            cap_sys_boot: Some(true),
            borrowed: Some(false),
            ..Default::default()
        }
    }

    fn signal(source: Source, kind: Kind, at: u64) -> ShutdownSignal {
        let s = ShutdownSignal::of(source, kind).without_sender().at(t(at));
        match source {
            Source::RebootSyscall => s.by(root(1, "systemd-shutdow")),
            Source::Exec => s
                .forced(true)
                .calling_reboot()
                .by(root(700, "poweroff"))
                .detail(Detail::Exec {
                    path: "/sbin/poweroff".into(),
                    binary: None,
                    argv: vec!["poweroff".into(), "-f".into()],
                    raw: String::new(),
                    truncated: false,
                }),
            _ => s.forced(false),
        }
    }

    /// The record the agent writes for these signals, in boot b1.
    fn record(signals: &[ShutdownSignal]) -> ShutdownRecord {
        crate::record::after("b1", signals)
    }

    /// A Node of boot b1, its Ready `ready` last written by its kubelet at
    /// `ready_at` (server time; the condition's own lastTransitionTime, the
    /// kubelet's clock, says a year later and is not read), with `rec`
    /// written at `written` (server time).
    fn node(rec: Option<&ShutdownRecord>, written: u64, ready: &str, ready_at: u64) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n1".into());
        let mut fields = vec![ManagedFieldsEntry {
            manager: Some("kubelet".into()),
            operation: Some("Update".into()),
            subresource: Some("status".into()),
            time: Some(stamp(ready_at)),
            fields_v1: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::FieldsV1(
                serde_json::json!({"f:status": {"f:conditions": {r#"k:{"type":"Ready"}"#: {}}}}),
            )),
            ..Default::default()
        }];
        if let Some(r) = rec {
            n.metadata.annotations = Some(
                [(RECORD_ANNOTATION.to_string(), r.to_json())]
                    .into_iter()
                    .chain(r.proof_mark().map(|p| (PROOF_ANNOTATION.to_string(), p)))
                    .collect(),
            );
            fields.push(ManagedFieldsEntry {
                manager: Some(RECORD_MANAGER.into()),
                operation: Some("Update".into()),
                time: Some(stamp(written)),
                ..Default::default()
            });
        }
        n.metadata.managed_fields = Some(fields);
        n.status = Some(NodeStatus {
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: ready.into(),
                last_transition_time: Some(stamp(ready_at + 365 * 86_400)),
                ..Default::default()
            }]),
            node_info: Some(NodeSystemInfo {
                boot_id: "b1".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        n
    }

    /// This controller's marks of a fence of boot `boot` (its annotations,
    /// its write at 103), the taint aside.
    fn marked_fenced(n: &mut Node, boot: &str) {
        let ann = n.metadata.annotations.get_or_insert_with(Default::default);
        ann.insert(TAINTED_BY_ANNOTATION.into(), "a".into());
        ann.insert(FENCED_BOOT_ANNOTATION.into(), boot.into());
        n.metadata
            .managed_fields
            .get_or_insert_with(Default::default)
            .push(ManagedFieldsEntry {
                manager: Some(FENCE_MANAGER.into()),
                time: Some(stamp(103)),
                ..Default::default()
            });
    }
    fn lease(written: u64) -> Lease {
        let mut l = Lease::default();
        l.metadata.managed_fields = Some(vec![
            ManagedFieldsEntry {
                manager: Some("kubelet".into()),
                time: Some(stamp(written)),
                ..Default::default()
            },
            ManagedFieldsEntry {
                manager: Some("other".into()),
                time: Some(stamp(0)),
                ..Default::default()
            },
        ]);
        l.spec = Some(LeaseSpec {
            lease_duration_seconds: Some(40),
            ..Default::default()
        });
        l
    }

    fn short(v: &Verdict) -> &'static str {
        match v {
            Verdict::Fence { .. } => "fence",
            Verdict::Wait { .. } => "wait",
            Verdict::Contradicted { .. } => "contradicted",
            Verdict::Untaint => "untaint",
            Verdict::BackOnSameBoot => "kept",
            Verdict::Fenced => "fenced",
            Verdict::Nothing { .. } => "-",
        }
    }

    fn kernel() -> ShutdownRecord {
        record(&[signal(Source::RebootSyscall, Kind::Poweroff, 100)])
    }

    /// Each case: a record and a Node, a Lease last written at `lease`,
    /// judged at server time `now`. The kernel's proof fences after the
    /// quiet time (2 s) whatever the Lease's phase; a direct tool's once the
    /// Lease is silent past 10 s + 2 s; nothing else fences.
    #[test]
    fn the_rule() {
        let graceful = record(&[signal(Source::Logind, Kind::Poweroff, 100)]);
        let graceful_end = record(&[
            signal(Source::Logind, Kind::Poweroff, 100),
            signal(Source::RebootSyscall, Kind::Poweroff, 130),
        ]);
        let direct = record(&[signal(Source::Exec, Kind::Poweroff, 100)]);
        let reboot = record(&[signal(Source::RebootSyscall, Kind::Reboot, 100)]);
        let mut forced_exec = signal(Source::Exec, Kind::Poweroff, 100);
        forced_exec.calls_reboot = false;
        let through_pid1 = record(&[forced_exec.clone()]);
        let final_unit = record(&[
            signal(Source::Logind, Kind::Poweroff, 100),
            signal(Source::FinalUnit, Kind::Poweroff, 130),
        ]);
        let final_sweep = record(&[forced_exec, signal(Source::FinalSweep, Kind::Poweroff, 130)]);
        let closed = |how| kernel().closed(how, "test", t(101));
        let ahead = {
            let mut r = kernel();
            r.at = Some(t(200));
            r
        };
        let other_boot = {
            let mut r = kernel();
            r.boot_id = "b0".into();
            r
        };
        type Case = (
            &'static str,
            ShutdownRecord,
            u64,
            Option<u64>,
            u64,
            &'static str,
        );
        #[rustfmt::skip]
        let cases: Vec<Case> = vec![
            // (what, record, written, lease written, now, verdict)
            ("the kernel's power-off, at once", kernel(), 100, Some(95), 101, "wait"),
            ("the kernel's power-off, 2 s quiet (stamps: 3 s)", kernel(), 100, Some(95), 103, "fence"),
            ("... whatever the kubelet's phase (it wrote in the same second)", kernel(), 100, Some(100), 103, "fence"),
            ("the kubelet wrote after the proof: alive", kernel(), 100, Some(101), 130, "contradicted"),
            ("a graceful shutdown announced: never on its own", graceful.clone(), 100, Some(50), 10_000, "-"),
            ("a graceful shutdown's last word: PID 1's reboot(2)", graceful_end, 130, Some(120), 133, "fence"),
            ("--force through PID 1: not until its reboot(2)", through_pid1, 100, Some(50), 10_000, "-"),
            ("the final unit's word: systemd-shutdown's sweep first", final_unit.clone(), 130, Some(120), 133, "wait"),
            ("... 2 s + 100 s (stamps: 103 s)", final_unit.clone(), 130, Some(120), 232, "wait"),
            ("... then fenced", final_unit, 130, Some(120), 233, "fence"),
            ("--force, the sweep's end: the unmount loop first", final_sweep.clone(), 130, Some(120), 232, "wait"),
            ("... then fenced", final_sweep, 130, Some(120), 233, "fence"),
            ("a direct tool, kubelet still renewing", direct.clone(), 100, Some(99), 111, "wait"),
            ("a direct tool, kubelet silent 13 s", direct.clone(), 100, Some(99), 113, "fence"),
            ("a direct tool, kubelet silent long before it: its quiet time first", direct.clone(), 100, Some(10), 108, "wait"),
            ("... 8 s quiet (stamps: 9 s)", direct.clone(), 100, Some(10), 109, "fence"),
            ("a direct tool, kubelet wrote after it", direct, 100, Some(102), 200, "contradicted"),
            ("no Lease to check", kernel(), 100, None, 200, "-"),
            ("a reboot: policy poweroff-only", reboot, 100, Some(95), 10_000, "-"),
            ("cancelled", closed(Closing::Cancelled), 101, Some(95), 200, "-"),
            ("abandoned", closed(Closing::Abandoned), 101, Some(95), 200, "-"),
            ("failed", closed(Closing::Failed), 101, Some(95), 200, "-"),
            ("back", closed(Closing::Back), 101, Some(95), 200, "-"),
            ("a record ahead of its write (a future at)", ahead, 100, Some(95), 300, "-"),
            ("another boot's record", other_boot, 100, Some(95), 200, "-"),
        ];
        for (what, rec, written, lease_at, now, want) in cases {
            let n = node(Some(&rec), written, "Unknown", 10);
            let l = lease_at.map(lease);
            let v = judge(&n, l.as_ref(), t(now), &cfg());
            assert_eq!(short(&v), want, "{what}: {v:?}");
        }
    }

    /// The golden records (`common/golden/`), as an agent of each format
    /// version wrote them, on a Node of their boot: both carry the
    /// kernel's proof (version 1's from its source), and fence after the
    /// quiet time.
    #[test]
    fn the_golden_records_fence_as_their_versions_say() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../common/golden");
        for (file, written) in [("record-v1.json", 500), ("record-v2.json", 1000)] {
            let raw = std::fs::read_to_string(dir.join(file)).unwrap();
            let rec = ShutdownRecord::parse(raw.trim()).unwrap();
            assert_eq!(
                rec.at.map(|a| a.duration_since(t(written)).is_ok()),
                Some(true)
            );
            let mut n = node(Some(&rec), written, "Unknown", 10);
            let ann = n.metadata.annotations.get_or_insert_with(Default::default);
            ann.insert(RECORD_ANNOTATION.into(), raw.trim().into());
            if let Some(s) = n.status.as_mut().and_then(|s| s.node_info.as_mut()) {
                s.boot_id.clone_from(&rec.boot_id);
            }
            let l = lease(written - 5);
            assert_eq!(
                short(&judge(&n, Some(&l), t(written + 1), &cfg())),
                "wait",
                "{file}"
            );
            let v = judge(&n, Some(&l), t(written + 3), &cfg());
            assert_eq!(short(&v), "fence", "{file}: {v:?}");
        }
    }

    /// The controller's cache keeps no image list and no field sets but
    /// the Ready condition's owner: every verdict reads the same.
    #[test]
    fn a_trimmed_node_is_judged_as_the_full_one() {
        use k8s_openapi::{
            api::core::v1::ContainerImage, apimachinery::pkg::apis::meta::v1::FieldsV1,
        };
        let rec = kernel();
        let c = cfg();
        let l = lease(90);
        for (ready, ready_at) in [("True", 50), ("True", 150), ("True", 100), ("Unknown", 10)] {
            let mut n = node(Some(&rec), 100, ready, ready_at);
            let fields = n.metadata.managed_fields.as_mut().unwrap();
            fields.push(ManagedFieldsEntry {
                manager: Some("kube-controller-manager".into()),
                time: Some(stamp(180)),
                fields_v1: Some(FieldsV1(serde_json::json!({"f:spec": {"f:podCIDR": {}}}))),
                ..Default::default()
            });
            n.status.as_mut().unwrap().images = Some(vec![ContainerImage {
                names: Some(vec!["registry.example.com/a:1".into()]),
                size_bytes: Some(1),
            }]);
            let full = short(&judge(&n, Some(&l), t(200), &c));
            super::super::pass::trim_node(&mut n);
            assert_eq!(
                short(&judge(&n, Some(&l), t(200), &c)),
                full,
                "Ready {ready} at {ready_at}"
            );
            assert!(n.status.as_ref().unwrap().images.is_none());
            let sets: Vec<bool> = n
                .metadata
                .managed_fields
                .iter()
                .flatten()
                .map(|m| m.fields_v1.is_some())
                .collect();
            assert_eq!(
                sets,
                [true, false, false],
                "only the Ready owner's field set is kept"
            );
        }
    }

    /// What the record does not carry is read from the Node as stored.
    #[test]
    fn the_node_decides_what_is_current() {
        let rec = kernel();
        let c = cfg();
        let l = lease(90);
        let fence = |n: &Node| short(&judge(n, Some(&l), t(200), &c));
        assert_eq!(fence(&node(Some(&rec), 100, "Unknown", 10)), "fence");
        // Ready turned True after the record was written: the kubelet lives
        // after the proof, as a Lease write after it would say.
        assert_eq!(fence(&node(Some(&rec), 100, "True", 150)), "contradicted");
        assert_eq!(fence(&node(Some(&rec), 100, "True", 50)), "fence");
        assert_eq!(fence(&node(Some(&rec), 100, "True", 101)), "contradicted");
        assert_eq!(
            fence(&node(Some(&rec), 100, "True", 100)),
            "fence",
            "Ready in the record's second: not certainly after it"
        );
        // No server time of the write: no evidence.
        let mut n = node(Some(&rec), 100, "Unknown", 10);
        n.metadata.managed_fields = None;
        assert_eq!(fence(&n), "-");
        // Another manager's write is not the record's.
        let mut n = node(Some(&rec), 100, "Unknown", 10);
        for m in n.metadata.managed_fields.iter_mut().flatten() {
            if m.manager.as_deref() == Some(RECORD_MANAGER) {
                m.manager = Some("kubectl".into());
            }
        }
        assert_eq!(fence(&n), "-");
        // No bootID, or another boot: no evidence.
        let mut n = node(Some(&rec), 100, "Unknown", 10);
        n.status.as_mut().unwrap().node_info = None;
        assert_eq!(fence(&n), "-");
        let mut n = node(Some(&rec), 100, "Unknown", 10);
        n.status
            .as_mut()
            .unwrap()
            .node_info
            .as_mut()
            .unwrap()
            .boot_id = "b2".into();
        assert_eq!(fence(&n), "-");
        // An unreadable record, or none.
        let mut n = node(Some(&rec), 100, "Unknown", 10);
        n.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(RECORD_ANNOTATION.into(), "{".into());
        assert_eq!(fence(&n), "-");
        assert_eq!(fence(&node(None, 100, "Unknown", 10)), "-");
        // Policies.
        let off = ControllerConfig {
            policy: FencePolicy::Off,
            ..cfg()
        };
        let n = node(Some(&rec), 100, "Unknown", 10);
        assert_eq!(short(&judge(&n, Some(&l), t(200), &off)), "-");
        let observe = ControllerConfig {
            policy: FencePolicy::Observe,
            ..cfg()
        };
        assert_eq!(
            short(&judge(&n, Some(&l), t(200), &observe)),
            "fence",
            "observe judges as poweroff-only; the pass writes nothing"
        );
        let reboots = ControllerConfig {
            policy: FencePolicy::AlsoReboots,
            ..cfg()
        };
        let reboot = record(&[signal(Source::RebootSyscall, Kind::Reboot, 100)]);
        let n = node(Some(&reboot), 100, "Unknown", 10);
        assert_eq!(
            short(&judge(&n, Some(&l), t(300), &reboots)),
            "-",
            "not back yet"
        );
        assert_eq!(
            short(&judge(&n, Some(&l), t(800), &reboots)),
            "fence",
            "down past the timeout"
        );
    }

    /// The proof admission reads (lastgasp.dev/proof) missing, or of
    /// another boot: no evidence (an older agent's record).
    #[test]
    fn the_proof_annotation_must_be_the_records() {
        let rec = kernel();
        let l = lease(90);
        let fence = |n: &Node| short(&judge(n, Some(&l), t(200), &cfg()));
        assert_eq!(fence(&node(Some(&rec), 100, "Unknown", 10)), "fence");
        let mut n = node(Some(&rec), 100, "Unknown", 10);
        n.metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove(PROOF_ANNOTATION);
        assert_eq!(fence(&n), "-");
        let mut n = node(Some(&rec), 100, "Unknown", 10);
        n.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(PROOF_ANNOTATION.into(), "kernel/b0".into());
        assert_eq!(fence(&n), "-");
    }

    /// A fence this controller set on this record and someone lifted by
    /// hand (the taint gone, its annotations kept) is not set again on it;
    /// a record written after the fence is judged as any.
    #[test]
    fn a_fence_lifted_by_hand_stays_lifted_on_its_record() {
        let lifted = |record_at: u64| {
            let rec = kernel();
            let mut n = node(Some(&rec), record_at, "Unknown", 10);
            marked_fenced(&mut n, "b1");
            short(&judge(&n, Some(&lease(90)), t(200), &cfg()))
        };
        assert_eq!(lifted(100), "-", "the record it fenced on");
        assert_eq!(lifted(150), "fence", "a record written after the fence");
        let mut earlier = node(Some(&kernel()), 100, "Unknown", 10);
        marked_fenced(&mut earlier, "b0");
        assert_eq!(
            short(&judge(&earlier, Some(&lease(90)), t(200), &cfg())),
            "fence",
            "an earlier boot's fence annotations say nothing of this one"
        );
    }

    /// The remediators' condition holds only while this controller's taint
    /// is on the Node, on the boot it fenced.
    #[test]
    fn the_condition_follows_the_taint() {
        let with = |taint: bool, ours: bool, boot: &str, cond: &str| {
            let mut n = node(Some(&kernel()), 100, "Unknown", 10);
            if taint {
                n.spec = Some(NodeSpec {
                    taints: Some(vec![Taint {
                        key: OUT_OF_SERVICE_KEY.into(),
                        effect: "NoExecute".into(),
                        ..Default::default()
                    }]),
                    ..Default::default()
                });
            }
            if ours {
                marked_fenced(&mut n, boot);
            } else {
                let ann = n.metadata.annotations.as_mut().unwrap();
                ann.insert(FENCED_BOOT_ANNOTATION.into(), boot.into());
            }
            n.status
                .as_mut()
                .unwrap()
                .conditions
                .as_mut()
                .unwrap()
                .push(NodeCondition {
                    type_: FENCED_CONDITION.into(),
                    status: cond.into(),
                    ..Default::default()
                });
            stale_condition(&n)
        };
        assert_eq!(with(true, true, "b1", "True"), None, "fenced, this boot");
        assert_eq!(
            with(false, true, "b1", "True"),
            Some("FenceLifted"),
            "taint removed by hand"
        );
        assert_eq!(
            with(true, false, "b1", "True"),
            Some("FenceLifted"),
            "not our taint"
        );
        assert_eq!(
            with(true, true, "b0", "True"),
            Some("NodeBack"),
            "another boot"
        );
        assert_eq!(with(false, true, "b1", "False"), None, "already False");
    }

    /// The episode's kind, not its first signal's: a path whose first
    /// signal names no kind is judged by what the later ones said.
    #[test]
    fn the_episodes_kind_counts() {
        let rec = record(&[
            signal(Source::Logind, Kind::Unknown, 100),
            signal(Source::RebootSyscall, Kind::Poweroff, 130),
        ]);
        assert_eq!(rec.kind(), Kind::Poweroff);
        let n = node(Some(&rec), 130, "Unknown", 10);
        assert_eq!(
            short(&judge(&n, Some(&lease(120)), t(140), &cfg())),
            "fence"
        );
    }

    /// A fenced node: ours or not; back on a new boot; alive again on the
    /// boot it was fenced in (Ready turned True after the fence, or its
    /// kubelet wrote its Lease after it), on the server's stamps alone.
    #[test]
    fn a_fenced_node() {
        let fenced = |ours: bool, boot: &str, ready: &str, ready_at: u64| {
            let mut n = node(Some(&kernel()), 100, ready, ready_at);
            n.spec = Some(NodeSpec {
                taints: Some(vec![Taint {
                    key: OUT_OF_SERVICE_KEY.into(),
                    effect: "NoExecute".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            });
            if ours {
                marked_fenced(&mut n, "b1");
            }
            n.status
                .as_mut()
                .unwrap()
                .node_info
                .as_mut()
                .unwrap()
                .boot_id = boot.into();
            n
        };
        // (ours, boot, Ready, its transition, the Lease's write, verdict, why)
        #[rustfmt::skip]
        let cases = [
            (false, "b1", "Unknown", 10, 90, "-", "not ours"),
            (true, "b1", "Unknown", 10, 90, "fenced", "ours, still down"),
            (true, "b2", "True", 150, 150, "untaint", "Ready on a new boot"),
            (true, "b2", "Unknown", 150, 150, "fenced", "a new boot, not Ready yet"),
            (true, "b1", "True", 10, 90, "fenced", "a Ready from before the fence is stale"),
            (true, "b1", "True", 120, 90, "kept", "Ready turned True after the fence"),
            (true, "b1", "Unknown", 10, 104, "kept", "the kubelet wrote after the fence"),
            (true, "b1", "Unknown", 10, 103, "fenced", "in the fence's second: not certainly after"),
        ];
        for (ours, boot, ready, ready_at, lease_at, want, why) in cases {
            let n = fenced(ours, boot, ready, ready_at);
            let got = short(&judge(&n, Some(&lease(lease_at)), t(200), &cfg()));
            assert_eq!(got, want, "{why}");
        }
    }

    /// Silence counts on the server's clock so that it can only be late:
    /// both stamps are whole seconds, so a second is taken off.
    #[test]
    fn a_lease_is_silent_only_past_its_interval() {
        let l = lease(100);
        let live = liveness(&l, t(113)).unwrap();
        assert_eq!(live.written, t(100));
        assert_eq!(live.silent, Duration::from_secs(12));
        assert_eq!(live.interval, Duration::from_secs(10));
        let mut no_time = lease(100);
        no_time.metadata.managed_fields = None;
        assert!(liveness(&no_time, t(200)).is_err());
        let mut no_duration = lease(100);
        no_duration.spec = None;
        assert!(liveness(&no_duration, t(200)).is_err());
    }
}
