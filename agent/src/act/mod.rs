//! The act stage: what a decision does. [`Actuator::act`] takes each
//! decision to one action (`graceful`, `last_gasp`, `unwind`), and
//! [`Actuator::after_boot`] tells the cluster how the previous boot ended.
//! The transport is below: `kube/` (the API writes), `audit` (the log on
//! disk), `courier` (the record systemd-shutdown's hook sends), `metrics`.
//!
//! In cluster mode the cluster half may join after the start
//! ([`Actuator::join_cluster`]): until then what needs the cluster is held,
//! and sent when it joins.
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use ::kube::runtime::events::EventType;
use tokio::sync::{watch, Mutex};

use crate::{
    bus::delay_lock::DelayLockHandle,
    decide::{Action, BeforeCluster, Decision, Episode, HostAnswer, HostQuery},
    record::{Closing, EpisodeKey, ShutdownRecord},
    signal::{Detail, ShutdownSignal, Source},
};

pub mod after_boot;
pub mod audit;
pub mod courier;
pub mod degraded;
pub mod final_unit;
mod graceful_run;
pub mod kube;
pub mod last_gasp;
pub mod metrics;
pub mod report;
mod unwind;

pub use after_boot::AfterBoot;

use self::{
    audit::{AuditLog, Outcome},
    graceful_run::GracefulRun,
    kube::{graceful::GracefulOptions, NodeClient},
    last_gasp::LastGasp,
    metrics::Metrics,
};

/// The last gasp gives up after this, and is delivered after the next boot.
pub const LAST_GASP_BOUND: Duration = Duration::from_secs(2);

/// What the agent reaches in cluster mode.
pub struct Cluster {
    pub node: NodeClient,
    pub lastgasp: LastGasp,
    pub graceful: Arc<GracefulOptions>,
}

/// What every action reaches, cloned into the tasks that act beside the loop.
#[derive(Clone)]
struct Hands {
    audit: Arc<Mutex<AuditLog>>,
    metrics: Metrics,
    logind: Option<DelayLockHandle>,
    boot_id: String,
}

impl Hands {
    async fn outcome(&self, episode: u32, outcome: Outcome) {
        if let Err(e) = self.audit.lock().await.outcome(episode, outcome) {
            self.metrics.audit_failures.inc();
            tracing::error!(error = format!("{e:#}"), "audit outcome NOT written");
        }
    }

    fn release_lock(&self) {
        if let Some(l) = &self.logind {
            l.release();
        }
    }
}

/// The cluster half: here, or still coming (and what waits for it).
#[derive(Default)]
struct ClusterLink {
    cluster: Option<Arc<Cluster>>,
    coming: Option<watch::Receiver<Option<Arc<Cluster>>>>,
    /// The previous boot's report, to deliver when the cluster joins.
    previous_boot: Option<after_boot::PreviousBoot>,
    /// The current episode's action that needed the cluster.
    unsent: Option<(ShutdownSignal, Action, u32)>,
    /// No previous boot to report: this boot's own open record is looked
    /// for when the cluster joins.
    orphan_pending: bool,
}

pub struct Actuator {
    hands: Hands,
    link: ClusterLink,
    graceful: GracefulRun,
    /// How the host is asked whether a shutdown is under way (an open record
    /// of this boot found at start is closed only when none is).
    host: HostQuery,
    /// How the last last gasp (or last word) went, until taken.
    last_delivery: Option<Outcome>,
    /// The run directory of systemd-shutdown's hook and the API server the
    /// agent was told to use: the courier's kit goes there.
    courier: Option<(PathBuf, Option<String>)>,
    /// The episode whose courier kit is on the host.
    kit_left: Option<u32>,
    /// The agent's health as its Node shows it (`LastgaspDegraded`).
    degraded: degraded::Degraded,
}

impl Actuator {
    pub fn new(
        audit: Arc<Mutex<AuditLog>>,
        cluster: Option<Arc<Cluster>>,
        logind: Option<DelayLockHandle>,
        metrics: Metrics,
        boot_id: String,
    ) -> Self {
        Actuator {
            hands: Hands {
                audit,
                metrics,
                logind,
                boot_id,
            },
            link: ClusterLink {
                cluster,
                ..ClusterLink::default()
            },
            graceful: GracefulRun::default(),
            host: Arc::new(|| Box::pin(async { HostAnswer::Unknown("no bus to ask".into()) })),
            last_delivery: None,
            courier: None,
            kit_left: None,
            degraded: degraded::Degraded::default(),
        }
    }

    /// Shows `state` on the Node once the cluster half is here (see
    /// `degraded`); the caller keeps it out of shutdowns.
    pub async fn report_degraded(&mut self, state: &degraded::State, now: std::time::Instant) {
        if let Some(c) = &self.link.cluster {
            self.degraded.report(&c.node, state, now).await;
        }
    }

    pub fn set_host(&mut self, host: HostQuery) {
        self.host = host;
    }

    /// How the host is asked whether a shutdown is under way.
    pub fn host(&self) -> HostQuery {
        self.host.clone()
    }

    pub fn set_courier(&mut self, run_dir: PathBuf, server: Option<String>) {
        self.courier = Some((run_dir, server));
    }

    /// Cluster mode whose cluster half joins later, through `coming`.
    pub fn set_cluster_coming(&mut self, coming: watch::Receiver<Option<Arc<Cluster>>>) {
        if self.link.cluster.is_none() {
            self.link.coming = Some(coming);
        }
    }

    /// In cluster mode: a record that leaves no time is not fsync'd before
    /// its last gasp (the two go side by side).
    pub fn in_cluster(&self) -> bool {
        self.link.cluster.is_some()
    }

    /// How the last last gasp or last word went, since the last call.
    pub fn take_delivery(&mut self) -> Option<Outcome> {
        self.last_delivery.take()
    }

    /// A graceful run is under way (it ends by releasing the logind lock).
    pub fn graceful_running(&self) -> bool {
        self.graceful.running()
    }

    /// The cluster half is here: kept, and the previous boot's report goes out.
    fn adopt(&mut self, c: Arc<Cluster>) {
        self.link.cluster = Some(c.clone());
        self.link.coming = None;
        if let Some(p) = self.link.previous_boot.take() {
            drop(self.deliver_previous_boot(c, p));
        } else if std::mem::take(&mut self.link.orphan_pending) {
            self.close_own_orphan();
        }
    }

    /// The cluster half, waiting at most `bound` for it to join.
    async fn cluster_within(&mut self, bound: Duration) -> Option<Arc<Cluster>> {
        if let Some(c) = &self.link.cluster {
            return Some(c.clone());
        }
        let mut coming = self.link.coming.clone()?;
        let c = match tokio::time::timeout(bound, coming.wait_for(Option::is_some)).await {
            Ok(Ok(c)) => c.clone()?,
            _ => return None,
        };
        self.adopt(c.clone());
        Some(c)
    }

    /// The cluster half is here: the previous boot's report goes out, and the
    /// current episode's (`current`) action that needed it is taken now. A
    /// record with a proof of death is not sent late in the same boot (the
    /// node is alive: the proof was wrong); it would reach the cluster after
    /// the next boot.
    pub async fn join_cluster(&mut self, c: Arc<Cluster>, current: Option<Episode>) {
        if self.link.cluster.is_none() {
            self.adopt(c);
        }
        let Some((s, action, id)) = self.link.unsent.take() else {
            return;
        };
        let Some(ep) = current.filter(|e| e.id == id) else {
            return;
        };
        if ep.death.is_some() {
            tracing::warn!(episode = id, "the API server answered after a shutdown with a proof of death that did not come: its record is not sent");
            return;
        }
        tracing::info!(episode = id, action = %action, "the API server answered: the episode's action is taken now");
        let d = Decision {
            action,
            episode: Some(ep),
        };
        self.act(Some(&s), &d).await;
    }

    /// Before the cluster joined: what must wait for it. `true` when the
    /// action is held entirely.
    fn hold_for_cluster(&mut self, s: Option<&ShutdownSignal>, d: &Decision, id: u32) -> bool {
        if self.link.coming.is_none() {
            return false;
        }
        match (d.action.before_cluster(), s) {
            (BeforeCluster::Held, Some(s)) => {
                // Held until the cluster joins (logind's delay lock stays
                // taken, up to its own limit).
                tracing::warn!(episode = id, action = %d.action, "the API server has not answered yet: the action waits for it");
                self.link.unsent = Some((s.clone(), d.action.clone(), id));
                return true;
            }
            // The last gasp waits for it within its own bound.
            (BeforeCluster::Bounded, Some(s)) => {
                self.link.unsent = Some((s.clone(), d.action.clone(), id));
            }
            (BeforeCluster::Clears, _) => self.link.unsent = None,
            _ => {}
        }
        false
    }

    /// The decision's action: `s` is the signal decided, `None` for a
    /// decision made by time or by the host's answer.
    pub async fn act(&mut self, s: Option<&ShutdownSignal>, d: &Decision) {
        let Some(ep) = d.episode.clone() else { return };
        if self.hold_for_cluster(s, d, ep.id) {
            return;
        }
        match (&d.action, s) {
            (Action::Graceful { .. }, Some(s)) => {
                let record = ShutdownRecord::new(&self.hands.boot_id, s, &ep);
                let cluster = self.link.cluster.clone();
                self.graceful.start(&self.hands, cluster, ep, record);
            }
            (Action::Immediate { escalated }, s) => {
                self.graceful.stop();
                if let Some(s) = s {
                    self.last_gasp(s, &ep, *escalated).await;
                }
            }
            // The kernel goes down: the record once more, with its proof.
            (Action::LastWord, Some(s)) => self.last_gasp(s, &ep, false).await,
            (Action::Cancel, _) => {
                self.graceful.stop();
                self.cancel(ep);
            }
            (Action::Abandon { why }, _) => {
                self.graceful.stop();
                self.unwind(ep, why.clone(), Closing::Abandoned);
            }
            (Action::Fail { why }, _) => {
                self.graceful.stop();
                self.unwind(ep, why.clone(), Closing::Failed);
            }
            (Action::Withdraw { why }, _) => self.withdraw(s, ep, why.clone()),
            (Action::Expire { why }, _) => self.expire(ep, why.clone()).await,
            (Action::Warn { due }, _) => self.warn(&ep, *due),
            _ => {}
        }
    }

    /// A scheduled shutdown: announced on the Node (a condition and an Event).
    fn warn(&self, ep: &Episode, due: Option<SystemTime>) {
        let Some(c) = self.link.cluster.clone() else {
            return;
        };
        let when = due
            .map(|t| humantime::format_rfc3339_seconds(t).to_string())
            .unwrap_or("later".into());
        let msg = format!("{} scheduled for {when}", ep.kind);
        tokio::spawn(async move {
            let (a, b) = tokio::join!(
                c.node.set_condition(true, "ScheduledShutdown", &msg),
                c.node
                    .event(EventType::Normal, "ScheduledShutdown", msg.clone()),
            );
            if let Err(e) = a.and(b) {
                tracing::error!(
                    error = format!("{e:#}"),
                    "announcing the scheduled shutdown"
                );
            }
        });
    }

    /// A pending request that never came to anything: its record closed.
    async fn expire(&self, ep: Episode, why: String) {
        if let Some(c) = self.link.cluster.clone() {
            let key = EpisodeKey::of(&self.hands.boot_id, &ep);
            let why = why.clone();
            tokio::spawn(async move {
                c.node.close_record(&key, Closing::Expired, &why).await;
            });
        }
        self.hands.outcome(ep.id, Outcome::Expired { why }).await;
    }

    /// An episode is open: for each verb systemd-shutdown may run its hook
    /// (or systemd the final unit) with, the record the hook's (the unit's)
    /// signal (decided as the paired decision)
    /// would have the agent send, with the final-stage proof, is left for
    /// the courier now, while the agent runs (the systemd cgroup driver
    /// stops its scope before systemd-shutdown; the runtime may kill it in
    /// the final sweep). The kit proves nothing by itself: the courier
    /// delivers it only from the final stage.
    pub async fn leave_courier_kit(&mut self, hooks: &[(ShutdownSignal, Decision)]) {
        let (Some((run_dir, server)), Some(c)) = (&self.courier, &self.link.cluster) else {
            return;
        };
        let mut evidence = std::collections::BTreeMap::new();
        let mut episode = None;
        for (hook, d) in hooks {
            let Some(ep) = d
                .episode
                .as_ref()
                .filter(|_| matches!(d.action, Action::LastWord | Action::Immediate { .. }))
            else {
                continue;
            };
            let Detail::Hook { verb } = &hook.detail else {
                continue;
            };
            let key = match hook.source {
                Source::FinalUnit => final_unit::key(verb),
                _ => verb.clone(),
            };
            let record = ShutdownRecord::new(&self.hands.boot_id, hook, ep);
            let (reason, message) = last_gasp::message(hook, ep.kind, false);
            let body = c
                .lastgasp
                .bodies(reason, &message, &record, SystemTime::now());
            evidence.insert(key, body.evidence);
            episode = Some(ep.id);
        }
        let Some(episode) = episode else {
            return self.drop_courier_kit();
        };
        let kit = match courier::credentials(server.as_deref()).await {
            Ok((server, root_certs, token)) => courier::Kit {
                server,
                root_certs,
                token,
                node: c.lastgasp.node().to_string(),
                evidence,
            },
            Err(e) => return tracing::warn!(error = format!("{e:#}"), "no courier kit"),
        };
        match courier::prepare(run_dir, &kit) {
            Ok(()) => {
                if self.kit_left != Some(episode) {
                    tracing::info!(episode, "courier kit left for systemd-shutdown's hook");
                }
                self.kit_left = Some(episode);
            }
            Err(e) => tracing::warn!(error = format!("{e:#}"), "no courier kit"),
        }
    }

    /// No episode: no kit (a later shutdown must not carry this one's record).
    pub fn drop_courier_kit(&mut self) {
        let (Some((run_dir, _)), Some(episode)) = (&self.courier, self.kit_left.take()) else {
            return;
        };
        match courier::remove(run_dir) {
            Ok(()) => tracing::info!(episode, "courier kit removed: the episode ended"),
            Err(e) => tracing::warn!(error = format!("{e:#}"), "courier kit NOT removed"),
        }
    }
}
