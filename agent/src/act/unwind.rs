//! Undoing: the shutdown did not come (cancelled, abandoned when the host
//! says none is under way, a pending request expired), so every mark the
//! episode made is taken off the Node, its record closed, and logind's delay
//! lock taken again.
use super::{audit::Outcome, kube::graceful, Cluster, Ctx};
use crate::{
    act::kube::NodeClient,
    decide::{HostAnswer, HostQuery},
    record::{Closing, EpisodeKey, ShutdownRecord},
    signal::ShutdownSignal,
};
use anyhow::Result;
use kube::runtime::events::EventType;

/// A scheduled shutdown cancelled: its condition, taint and record undone.
pub(super) fn cancel(cx: Ctx) {
    let Ctx { hands, cluster, ep } = cx;
    let key = EpisodeKey::of(&hands.boot_id, &ep);
    tokio::spawn(async move {
        if let Some(c) = &cluster {
            let (undone, ()) = tokio::join!(
                graceful::cancel(&c.node, &ep),
                c.node
                    .close_record(&key, Closing::Cancelled, "the shutdown was cancelled"),
            );
            if let Err(e) = undone {
                tracing::error!(
                    error = format!("{e:#}"),
                    "undoing the shutdown in the cluster"
                );
            }
        }
        hands.outcome(ep.id, Outcome::Cancelled).await;
    });
}

/// The shutdown did not come (`Abandoned`), or its proof of death was
/// wrong (`Failed`): the record closed first (it is the evidence a fence
/// stands on), then every mark the episode made undone, and the delay lock
/// taken again for the next one.
pub(super) fn unwind(cx: Ctx, why: String, how: Closing) {
    let Ctx { hands, cluster, ep } = cx;
    let key = EpisodeKey::of(&hands.boot_id, &ep);
    tokio::spawn(async move {
        if let (Some(c), true) = (&cluster, ep.marked) {
            c.node.close_record(&key, how, &why).await;
            let msg = format!("episode {}: {why}", ep.id);
            if let Err(e) = unmark(&c.node, &msg).await {
                tracing::error!(
                    error = format!("{e:#}"),
                    "undoing the abandoned shutdown's marks"
                );
            }
        }
        let outcome = match how {
            Closing::Failed => Outcome::Failed { why },
            _ => Outcome::Abandoned { why },
        };
        hands.outcome(ep.id, outcome).await;
        if let Some(l) = hands.logind {
            l.relock();
        }
    });
}

/// The proof of death was wrong, and the shutdown goes on: the record
/// written again without it (`s`: the signal that withdrew it, if any).
pub(super) fn withdraw(cx: Ctx, s: Option<&ShutdownSignal>, why: String) {
    let Ctx { hands, cluster, ep } = cx;
    let record = match s {
        Some(s) => ShutdownRecord::new(&hands.boot_id, s, &ep),
        None => ShutdownRecord::of_episode(&hands.boot_id, &ep, std::time::SystemTime::now()),
    };
    tokio::spawn(async move {
        if let (Some(c), true) = (&cluster, ep.marked) {
            match c.node.set_record(&record).await {
                Ok(()) => tracing::warn!(
                    episode = ep.id,
                    "the record's proof of death withdrawn: {why}"
                ),
                Err(e) => tracing::error!(
                    error = format!("{e:#}"),
                    "the record's proof of death NOT withdrawn"
                ),
            }
        }
        hands.outcome(ep.id, Outcome::Withdrawn { why }).await;
    });
}

/// The agent's own marks off: its taint, its condition False, an Event.
async fn unmark(node: &NodeClient, msg: &str) -> Result<()> {
    let (t, cond, ev) = tokio::join!(
        node.set_taint(false),
        node.set_condition(false, "ShutdownAbandoned", msg),
        node.event(EventType::Normal, "ShutdownAbandoned", msg.to_string()),
    );
    t.and(cond).and(ev)
}

/// A record of this boot still open when the agent starts (it restarted,
/// or userspace did: a soft-reboot keeps the boot id). The boot went on,
/// so a proof of death in it was wrong (a reboot(2) that failed); without
/// one, the host is asked, and the record closed with the agent's marks
/// when no shutdown is under way. Under way: it stays, and the shutdown's
/// own last word follows.
pub(super) async fn close_orphan(c: &Cluster, host: &HostQuery, rec: ShutdownRecord) {
    let (how, why) = match rec.death() {
        Some(d) => (
            Closing::Failed,
            format!("this boot went on after the record's proof ({})", d.by),
        ),
        None => match host().await {
            HostAnswer::NotUnderWay => (
                Closing::Abandoned,
                "the agent started again in the record's boot and neither logind nor systemd has a shutdown under way".to_string(),
            ),
            answer => {
                tracing::warn!(?answer, "an open shutdown record of this boot: left open");
                return;
            }
        },
    };
    let key = rec.key();
    let msg = format!("episode {}: {why}", key.id.unwrap_or(0));
    let (marks, ()) = tokio::join!(unmark(&c.node, &msg), c.node.close_record(&key, how, &why));
    if let Err(e) = marks {
        tracing::error!(error = format!("{e:#}"), "undoing an earlier start's marks");
    }
}

/// A pending request that never came to anything: its record closed.
pub(super) async fn expire(cx: Ctx, why: String) {
    let Ctx { hands, cluster, ep } = cx;
    if let Some(c) = cluster {
        let key = EpisodeKey::of(&hands.boot_id, &ep);
        let why = why.clone();
        tokio::spawn(async move {
            c.node.close_record(&key, Closing::Expired, &why).await;
        });
    }
    hands.outcome(ep.id, Outcome::Expired { why }).await;
}
