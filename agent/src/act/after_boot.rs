//! At start: how did the previous boot end? Read from the audit log
//! (`report`), logged, and told to the cluster beside the loop: the
//! PreviousBoot Event, a record the disk has and the Node lacks (or the
//! reverse), and the agent's own marks cleared once the node is Ready.
use std::{collections::BTreeSet, fmt::Write as _, path::Path, sync::Arc, time::SystemTime};

use anyhow::Result;
use kube::runtime::events::EventType;
use tokio::task::JoinHandle;

use super::{
    audit::{self, AuditRecord, Entry, Outcome},
    report::{self, BootEnd, BootReport},
    unwind, Cluster, Hands,
};
use crate::{
    decide::{Episode, HostQuery},
    record::{ShutdownRecord, UnannouncedEnd},
};

/// How the previous boot ended, and the task that tells the cluster (the
/// PreviousBoot Event and an undelivered record; it then leaves a task that
/// clears the marks once the node is Ready).
pub struct AfterBoot {
    /// From the audit log alone.
    pub report: BootReport,
    /// Ends with the report as the cluster half settled it (the Node's
    /// record may add what the disk lost).
    pub delivery: Option<JoinHandle<BootReport>>,
}

/// The previous boot as the audit log tells it, for the cluster half.
pub(super) struct PreviousBoot {
    prev: String,
    current: String,
    report: BootReport,
    records: Vec<AuditRecord>,
    pstore: Vec<(String, String)>,
}

/// The previous boot as the audit log tells it (logged, and its end counted
/// unless the cluster half will settle it): `None` when there is none.
pub(super) async fn previous_boot(
    hands: &Hands,
    boot_id: &str,
    cluster_mode: bool,
) -> Result<Option<PreviousBoot>> {
    let contents = {
        let mut audit = hands.audit.lock().await;
        let path = audit.path().to_path_buf();
        audit.agent_start()?;
        audit::read(&path)?
    };
    let prev = report::previous_boot(&contents.records, boot_id).map(str::to_string);
    let ends: BTreeSet<&str> = contents
        .records
        .iter()
        .map(|r| r.boot_id.as_str())
        .collect();
    for end in ends {
        // The previous boot is counted once the Node has been read.
        let later = cluster_mode && Some(end) == prev.as_deref();
        if end != boot_id && !later {
            let r = report::classify(&contents.records, end);
            hands.metrics.count_boot_end(r.end.as_str());
        }
    }
    let Some(prev) = prev else {
        return Ok(None);
    };
    let r = report::classify(&contents.records, &prev);
    let pstore = report::pstore(Path::new("/sys/fs/pstore"), 3);
    let note = previous_boot_note(&r, &pstore);
    tracing::info!(
        boot = prev,
        end = r.end.as_str(),
        undelivered = r.undelivered,
        "{note}"
    );
    Ok(Some(PreviousBoot {
        prev,
        current: boot_id.to_string(),
        report: r,
        records: contents.records,
        pstore,
    }))
}

impl PreviousBoot {
    pub(super) fn report(&self) -> &BootReport {
        &self.report
    }
}

/// No earlier boot in the audit (the agent's first on this node, its log
/// lost): a record of this boot that an earlier start of the agent left open
/// is still closed, beside the loop.
pub(super) fn close_own_orphan(c: Arc<Cluster>, hands: &Hands, host: &HostQuery) {
    let (host, boot_id) = (host.clone(), hands.boot_id.clone());
    tokio::spawn(async move {
        match c.node.record().await {
            Ok(Some(rec)) if rec.boot_id == boot_id && rec.closed.is_none() => {
                unwind::close_orphan(&c, &host, rec).await;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "reading the Node's shutdown record"
            ),
        }
    });
}

/// The cluster half of the previous boot's report, beside the loop: with the
/// API server slow its retries (seconds) must not delay the audit of the
/// next shutdown.
pub(super) fn deliver(
    c: Arc<Cluster>,
    hands: &Hands,
    host: &HostQuery,
    mut p: PreviousBoot,
) -> JoinHandle<BootReport> {
    let (hands, host) = (hands.clone(), host.clone());
    tokio::spawn(async move {
        let (report, found) = settle_with_node(&c, &hands, &host, &mut p).await;
        hands.metrics.count_boot_end(report.end.as_str());
        let mut note = previous_boot_note(&report, &p.pstore);
        if found {
            note.push_str(
                "; the audit log lacked it: found on the Node (the cluster had it before the boot ended)",
            );
        }
        // The pod's log says it too (`kubectl logs`, and the VM runner).
        tracing::info!(boot = p.prev, end = report.end.as_str(), "{note}");
        let type_ = if report.end == BootEnd::Graceful {
            EventType::Normal
        } else {
            EventType::Warning
        };
        if let Err(e) = c.node.event(type_, "PreviousBoot", note).await {
            tracing::warn!(error = format!("{e:#}"), "previous-boot event");
        }
        if let (true, Some(ep)) = (report.undelivered, &report.episode) {
            deliver_late(&c, &hands, &p, ep).await;
        }
        if report.end == BootEnd::Unannounced {
            let end = UnannouncedEnd {
                boot_id: p.prev.clone(),
                last_seen: p
                    .records
                    .iter()
                    .filter(|r| r.boot_id == p.prev)
                    .map(|r| r.written_at)
                    .max(),
                reported_at: SystemTime::now(),
            };
            if let Err(e) = c.node.set_unannounced(&end).await {
                tracing::warn!(error = format!("{e:#}"), "reporting the unannounced end");
            }
        }
        let clear = p.current.clone();
        tokio::spawn(async move {
            if let Err(e) = c.node.clear_when_ready(&clear).await {
                tracing::warn!(error = format!("{e:#}"), "clearing the shutdown marks");
            }
        });
        report
    })
}

/// The report as the Node settles it: a last gasp the cluster acknowledged
/// while its record (or its outcome) never reached the disk is still on the
/// Node (`true`: found there); a record of this boot left open is closed.
async fn settle_with_node(
    c: &Cluster,
    hands: &Hands,
    host: &HostQuery,
    p: &mut PreviousBoot,
) -> (BootReport, bool) {
    let on_node = match c.node.record().await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(
                error = format!("{e:#}"),
                "reading the Node's shutdown record"
            );
            None
        }
    };
    match on_node {
        Some(rec) if rec.boot_id == p.prev => {
            let ep = report::episode_of(&rec).map_or(0, |e| e.id);
            let outcome = Outcome::FoundOnNode {
                boot_id: p.prev.clone(),
                record: serde_json::to_value(&rec).unwrap_or_default(),
            };
            p.records.push(AuditRecord {
                boot_id: p.current.clone(),
                seq: 0,
                written_at: SystemTime::now(),
                entry: Entry::Outcome {
                    episode: ep,
                    outcome: outcome.clone(),
                },
            });
            let with = report::classify(&p.records, &p.prev);
            if with != p.report {
                hands.outcome(ep, outcome).await;
                return (with, true);
            }
        }
        Some(rec) if rec.boot_id == p.current && rec.closed.is_none() => {
            unwind::close_orphan(c, host, rec).await;
        }
        _ => {}
    }
    (p.report.clone(), false)
}

/// The previous boot's record, which never reached the cluster, set on the
/// Node now (unless it already carries this boot's).
async fn deliver_late(c: &Cluster, hands: &Hands, p: &PreviousBoot, ep: &Episode) {
    let record = ShutdownRecord::late(&p.prev, ep, SystemTime::now());
    match c.node.set_earlier_record(&record, &p.current).await {
        Ok(true) => {
            hands.metrics.last_gasps_delivered_late.inc();
            let late = Outcome::DeliveredLate {
                boot_id: p.prev.clone(),
            };
            hands.outcome(ep.id, late).await;
        }
        Ok(false) => tracing::warn!(
            "the previous boot's record was not delivered: the node already carries this boot's"
        ),
        Err(e) => tracing::warn!(
            error = format!("{e:#}"),
            "delivering the previous boot's record"
        ),
    }
}

/// An episode's timeline in a line (entries left out counted where they were).
fn timeline_text(ep: &Episode) -> String {
    let mut parts: Vec<String> = ep.timeline.iter().map(|e| e.summary.clone()).collect();
    if ep.timeline_omitted > 0 && parts.len() > 1 {
        parts.insert(1, format!("({} more)", ep.timeline_omitted));
    }
    parts.join("; ")
}

/// The PreviousBoot Event's note: how the boot ended, by which episode, and
/// the kernel's last words when nothing announced it.
fn previous_boot_note(r: &BootReport, pstore: &[(String, String)]) -> String {
    let mut note = match &r.episode {
        Some(ep) => format!(
            "previous boot {} ended {} ({}, episode {}): {}",
            r.boot_id,
            r.end.as_str(),
            ep.kind,
            ep.id,
            timeline_text(ep)
        ),
        None => format!(
            "previous boot {} ended unannounced: no shutdown was seen (power loss, reset, watchdog or panic)",
            r.boot_id
        ),
    };
    if let (Some(t), Some(rem)) = (r.pods_terminated, r.pods_remaining) {
        let _ = write!(note, "; pods terminated {t}, still running {rem}");
    }
    if r.end == BootEnd::Unannounced {
        for (name, first) in pstore {
            let _ = write!(note, "; pstore {name}: {}", first.replace('\n', " | "));
        }
    }
    note
}
