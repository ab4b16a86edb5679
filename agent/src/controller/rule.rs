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
//! - a direct tool (`poweroff -f`): fenced once the kubelet's Lease is
//!   silent past its renew interval and the margin, since nothing stops the
//!   kubelet before the tool's own reboot(2).
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
    ControllerConfig, Policy, FENCED_BOOT_ANNOTATION, FENCE_MANAGER, OUT_OF_SERVICE_KEY,
    TAINTED_BY_ANNOTATION,
};
use crate::{
    decide::Proof,
    record::{self, managed_time, ShutdownRecord, MAX_SKEW},
    signal::Kind,
};

/// Server stamps (`managedFields[].time`, the `Date` header) are whole
/// seconds: a time read as `t` is in `[t, t + 1 s)`.
const STAMP: Duration = Duration::from_secs(1);

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
fn ready_condition(node: &Node) -> Option<&NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// When Ready last turned True, while it is True.
pub fn ready_since(node: &Node) -> Option<SystemTime> {
    let c = ready_condition(node).filter(|c| c.status == "True")?;
    c.last_transition_time
        .as_ref()
        .map(|t| SystemTime::from(t.0))
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
fn fenced_at(node: &Node) -> Option<SystemTime> {
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
    if cfg.policy == Policy::Off {
        return Verdict::nothing("");
    }
    let rec = match record::of_node(node) {
        None => return Verdict::nothing(""),
        Some(Err(e)) => return Verdict::nothing(e),
        Some(Ok(r)) => r,
    };
    match evidence(node, &rec, now, cfg) {
        Err(why) => Verdict::nothing(why),
        Ok(ev) => weigh(&ev, lease, now, cfg),
    }
}

/// A current record's proof, and the server's time of its write.
struct Evidence {
    proof: Proof,
    written: SystemTime,
    what: String,
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
    if let Some(r) = ready_since(node).filter(|r| *r >= written) {
        return Err(format!(
            "it is older than the node's last Ready ({})",
            humantime::format_rfc3339_seconds(r)
        ));
    }
    let kind = rec.kind();
    match kind {
        Kind::Poweroff | Kind::Halt => {}
        Kind::Reboot | Kind::Kexec | Kind::SoftReboot | Kind::Unknown
            if cfg.policy == Policy::AlsoReboots =>
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
    Ok(Evidence {
        proof: death.proof,
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
fn weigh(
    ev: &Evidence,
    lease: Option<&Lease>,
    now: SystemTime,
    cfg: &ControllerConfig,
) -> Verdict {
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
        Proof::Kernel => {
            let stood = now
                .duration_since(ev.written)
                .unwrap_or_default()
                .saturating_sub(STAMP);
            if stood >= cfg.proof_quiet {
                Verdict::Fence {
                    why: format!("{}; the kernel's power-off, {}s ago", ev.what, stood.as_secs()),
                }
            } else {
                Verdict::Wait {
                    why: format!("{}; quiet for {}s first", ev.what, cfg.proof_quiet.as_secs()),
                }
            }
        }
        Proof::DirectTool => {
            if live.silent > live.interval + cfg.lease_margin {
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
    let ready_after = ready_since(node).is_some_and(|r| r >= fenced);
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
