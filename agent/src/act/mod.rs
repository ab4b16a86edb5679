//! The act stage: what a decision does. [`Actuator::act`] is the
//! dispatcher: each decision's action is a function over a [`Ctx`] (the
//! node's hands, the cluster if it has joined, the episode), in a file of its
//! own (`graceful_run`, `last_gasp`, `unwind`, `warn`); [`Actuator::after_boot`]
//! tells the cluster how the previous boot ended. The transport is below:
//! `kube/` (the API writes), `audit` (the log on disk), `courier` (the
//! record systemd-shutdown's hook sends), `metrics`.
//!
//! In cluster mode the cluster half may join after the start: `gate` holds
//! what needs it until then, and the dispatcher replays it on the join.
use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::{watch, Mutex};

use crate::{
    bus::delay_lock::DelayLockHandle,
    decide::{Action, Decision, Episode, HostAnswer, HostQuery},
    record::{Closing, ShutdownRecord},
    signal::ShutdownSignal,
};

pub mod after_boot;
pub mod audit;
pub mod courier;
pub mod degraded;
pub mod final_unit;
mod gate;
mod graceful_run;
mod kit;
pub mod kube;
pub mod last_gasp;
pub mod metrics;
pub mod report;
mod unwind;
mod warn;

pub use after_boot::AfterBoot;

use self::{
    audit::{AuditLog, Outcome},
    gate::{Gate, Held},
    graceful_run::GracefulRun,
    kube::{graceful::GracefulOptions, NodeClient},
    last_gasp::{LastGasp, Reach},
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

/// What an action is given.
struct Ctx {
    hands: Hands,
    /// `None`: standalone, or the cluster half has not joined yet.
    cluster: Option<Arc<Cluster>>,
    ep: Episode,
}

pub struct Actuator {
    hands: Hands,
    gate: Gate,
    graceful: GracefulRun,
    /// How the host is asked whether a shutdown is under way (an open record
    /// of this boot found at start is closed only when none is).
    host: HostQuery,
    /// How the last last gasp (or last word) went, until taken.
    last_delivery: Option<Outcome>,
    /// Where the courier's kit goes, when systemd-shutdown's hook is there.
    kit: Option<kit::Shelf>,
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
            gate: Gate::new(cluster),
            graceful: GracefulRun::default(),
            host: Arc::new(|| Box::pin(async { HostAnswer::Unknown("no bus to ask".into()) })),
            last_delivery: None,
            kit: None,
            degraded: degraded::Degraded::default(),
        }
    }

    /// Shows `state` on the Node once the cluster half is here (see
    /// `degraded`); the caller keeps it out of shutdowns.
    pub async fn report_degraded(&mut self, state: &degraded::State, now: Instant) {
        if let Some(c) = self.gate.here() {
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
        self.kit = Some(kit::Shelf::new(run_dir, server));
    }

    /// Cluster mode whose cluster half joins later, through `coming`.
    pub fn set_cluster_coming(&mut self, coming: watch::Receiver<Option<Arc<Cluster>>>) {
        self.gate.expect(coming);
    }

    /// In cluster mode: a record that leaves no time is not fsync'd before
    /// its last gasp (the two go side by side).
    pub fn in_cluster(&self) -> bool {
        self.gate.here().is_some()
    }

    /// How the last last gasp or last word went, since the last call.
    pub fn take_delivery(&mut self) -> Option<Outcome> {
        self.last_delivery.take()
    }

    /// A graceful run is under way (it ends by releasing the logind lock).
    pub fn graceful_running(&self) -> bool {
        self.graceful.running()
    }

    /// Reported as an Event (and a log line), with whatever did not reach
    /// the cluster then; then the agent's own taint and condition are
    /// cleared once the node is Ready.
    pub async fn after_boot(&mut self, boot_id: &str) -> anyhow::Result<Option<AfterBoot>> {
        let cluster_mode = self.gate.here().is_some() || self.gate.coming();
        let Some(p) = after_boot::previous_boot(&self.hands, boot_id, cluster_mode).await? else {
            self.report(Held::OwnOrphan);
            return Ok(None);
        };
        let report = p.report().clone();
        let delivery = match self.gate.here() {
            Some(c) => Some(after_boot::deliver(c, &self.hands, &self.host, p)),
            None => {
                self.gate.hold(Held::PreviousBoot(p));
                None
            }
        };
        Ok(Some(AfterBoot { report, delivery }))
    }

    /// What tells the cluster of a boot: now, or once it joins.
    fn report(&mut self, h: Held) {
        let Some(c) = self.gate.here() else {
            self.gate.hold(h);
            return;
        };
        match h {
            Held::PreviousBoot(p) => drop(after_boot::deliver(c, &self.hands, &self.host, p)),
            Held::OwnOrphan => after_boot::close_own_orphan(c, &self.hands, &self.host),
            Held::Action { .. } => {}
        }
    }

    /// What waited for the cluster, now that it is here: the boot's reports
    /// go out; the held action is returned.
    fn replay(&mut self, held: Vec<Held>) -> Option<(ShutdownSignal, Action, u32)> {
        let mut action = None;
        for h in held {
            match h {
                Held::Action {
                    signal,
                    action: a,
                    episode,
                } => action = Some((signal, a, episode)),
                h => self.report(h),
            }
        }
        action
    }

    /// The cluster half is here: the previous boot's report goes out, and the
    /// current episode's (`current`) action that needed it is taken now. A
    /// record with a proof of death is not sent late in the same boot (the
    /// node is alive: the proof was wrong); it would reach the cluster after
    /// the next boot.
    pub async fn join_cluster(&mut self, c: Arc<Cluster>, current: Option<Episode>) {
        let held = self.gate.join(c);
        let Some((s, action, id)) = self.replay(held) else {
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

    /// The decision's action: `s` is the signal decided, `None` for a
    /// decision made by time or by the host's answer.
    pub async fn act(&mut self, s: Option<&ShutdownSignal>, d: &Decision) {
        let Some(ep) = d.episode.clone() else { return };
        if self.gate.admit(s, &d.action, ep.id) {
            return;
        }
        if d.action.ends_graceful_run() {
            self.graceful.stop();
        }
        let cx = Ctx {
            hands: self.hands.clone(),
            cluster: self.gate.here(),
            ep,
        };
        match (&d.action, s) {
            (Action::Graceful { .. }, Some(s)) => {
                let record = ShutdownRecord::new(&cx.hands.boot_id, s, &cx.ep);
                self.graceful.start(cx, record);
            }
            (Action::Immediate { escalated }, Some(s)) => self.last_gasp(cx, s, *escalated).await,
            // The kernel goes down: the record once more, with its proof.
            (Action::LastWord, Some(s)) => self.last_gasp(cx, s, false).await,
            (Action::Cancel, _) => unwind::cancel(cx),
            (Action::Abandon { why }, _) => unwind::unwind(cx, why.clone(), Closing::Abandoned),
            (Action::Fail { why }, _) => unwind::unwind(cx, why.clone(), Closing::Failed),
            (Action::Withdraw { why }, _) => unwind::withdraw(cx, s, why.clone()),
            (Action::Expire { why }, _) => unwind::expire(cx, why.clone()).await,
            (Action::Warn { due }, _) => warn::warn(cx, *due),
            _ => {}
        }
    }

    /// The last gasp, once the cluster is here (waited for within its bound).
    async fn last_gasp(&mut self, cx: Ctx, s: &ShutdownSignal, escalated: bool) {
        let started = Instant::now();
        let coming = self.gate.coming();
        let reach = match self.gate.within(LAST_GASP_BOUND).await {
            Some((c, held)) => {
                // Sent now: the held action is this one.
                drop(self.replay(held));
                self.gate.drop_action();
                Reach::Here(c)
            }
            // Still held: sent when the cluster joins, unless a proof of
            // death was wrong by then (`join_cluster`).
            None if coming => Reach::NotYet(started.elapsed()),
            None => Reach::Standalone,
        };
        if let Some(outcome) = last_gasp::last_gasp(&cx, reach, s, escalated, started).await {
            self.last_delivery = Some(outcome);
        }
    }

    /// An episode is open: the courier's kit for it is left on the host
    /// (`kit`), in cluster mode with systemd-shutdown's hook there.
    pub async fn leave_courier_kit(&mut self, hooks: &[(ShutdownSignal, Decision)]) {
        if let (Some(shelf), Some(c)) = (&mut self.kit, self.gate.here()) {
            shelf.leave(&c, &self.hands.boot_id, hooks).await;
        }
    }

    /// No episode: no kit (a later shutdown must not carry this one's record).
    pub fn drop_courier_kit(&mut self) {
        if let Some(shelf) = &mut self.kit {
            shelf.clear();
        }
    }
}
