//! The agent's one loop body: each `ShutdownSignal` is enriched, decided,
//! audited (fsync'd before it acts, or for the last gasp while its patches
//! leave) and then acted on; time passing is decided
//! too (pending requests expire, episodes past their end are checked with the
//! host and unwound). Detection → decision → action, one way.
//!
//! Nothing here waits on the network for long: the last gasp is bounded
//! (`LAST_GASP_BOUND`), and Events, cancels, warnings, unwinding and the
//! host check run as tasks beside the loop. In cluster mode the cluster half
//! may join after the start ([`Agent::join_cluster`]): until then signals are
//! decided and audited as always, and what needed the cluster is sent when
//! it joins.
use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use anyhow::Result;
use kube::runtime::events::EventType;
use serde_json::json;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
};

use crate::{
    act::{
        audit::{AuditLog, Durability, Outcome},
        kube::{
            graceful::{self, GracefulOptions},
            lastgasp::{self, LastGasp},
            NodeClient,
        },
        metrics::Metrics,
    },
    decide::{self, Action, Decider, Decision, Episode, HostAnswer, HostQuery, Policy, Tick},
    detect::{actor, clock, logind::LogindHandle},
    record::{Closing, EpisodeKey, ShutdownRecord},
    report::{self, BootEnd, BootReport},
    signal::ShutdownSignal,
};

mod run;

pub use run::{outlive_final_kill, run, RunArgs};

/// The last gasp gives up after this, and is delivered after the next boot.
pub const LAST_GASP_BOUND: Duration = Duration::from_secs(2);

/// The host's answer about an episode (its id).
pub type Answer = (u32, HostAnswer);

/// How the previous boot ended, and the task that tells the cluster (the
/// PreviousBoot Event and an undelivered record; it then leaves a task that
/// clears the marks once the node is Ready).
pub struct AfterBoot {
    /// From the audit log alone.
    pub report: BootReport,
    /// Ends with the report as the cluster half settled it (the Node's
    /// record may add what the disk lost).
    pub delivery: Option<tokio::task::JoinHandle<BootReport>>,
}

/// What the agent reaches in cluster mode.
pub struct Cluster {
    pub node: NodeClient,
    pub lastgasp: LastGasp,
    pub graceful: Arc<GracefulOptions>,
}

pub struct Agent {
    decider: Decider,
    audit: Arc<tokio::sync::Mutex<AuditLog>>,
    cluster: Option<Arc<Cluster>>,
    logind: Option<LogindHandle>,
    metrics: Metrics,
    /// Print each signal as a JSON line (standalone mode).
    print: bool,
    boot_id: String,
    /// The graceful run, and the task that joins it.
    graceful: Option<(tokio::task::AbortHandle, JoinHandle<()>)>,
    host: HostQuery,
    /// Whether logind or systemd can be reached now.
    host_reachable: Arc<dyn Fn() -> bool + Send + Sync>,
    /// The host's answers, by the episode asked about.
    answers: (mpsc::Sender<Answer>, mpsc::Receiver<Answer>),
    /// How the last last gasp (or last word) went, until taken.
    last_delivery: Option<Outcome>,
    /// Cluster mode, before the cluster half joined: where it will come.
    cluster_coming: Option<watch::Receiver<Option<Arc<Cluster>>>>,
    /// Before it joined: the previous boot's report to deliver, and the
    /// current episode's action that needed the cluster.
    previous_boot: Option<PreviousBoot>,
    unsent: Option<(ShutdownSignal, Action, u32)>,
    /// The run directory of systemd-shutdown's hook and the API server the
    /// agent was told to use: the courier's kit goes there.
    courier: Option<(std::path::PathBuf, Option<String>)>,
}

/// The previous boot as the audit log tells it, for the cluster half.
struct PreviousBoot {
    prev: String,
    current: String,
    report: BootReport,
    records: Vec<crate::act::audit::Record>,
    pstore: Vec<(String, String)>,
}

impl Agent {
    pub fn new(
        audit: AuditLog,
        cluster: Option<Arc<Cluster>>,
        logind: Option<LogindHandle>,
        metrics: Metrics,
        print: bool,
    ) -> Self {
        Agent {
            decider: Decider::new(),
            boot_id: audit.boot_id().to_string(),
            audit: Arc::new(tokio::sync::Mutex::new(audit)),
            cluster,
            logind,
            metrics,
            print,
            graceful: None,
            host: Arc::new(|| Box::pin(async { HostAnswer::Unknown("no bus to ask".into()) })),
            host_reachable: Arc::new(|| true),
            answers: mpsc::channel(4),
            last_delivery: None,
            cluster_coming: None,
            previous_boot: None,
            unsent: None,
            courier: None,
        }
    }

    /// With systemd-shutdown's hook in `run_dir`: a courier kit is left
    /// there once PID 1 is systemd-shutdown (`act::courier`).
    pub fn with_courier(mut self, run_dir: std::path::PathBuf, server: Option<String>) -> Self {
        self.courier = Some((run_dir, server));
        self
    }

    /// PID 1 has become systemd-shutdown: the record its hook's signal
    /// would have the agent send (with the final-stage proof) is left for
    /// the courier, in case the runtime kills the agent before the hook.
    async fn leave_courier_kit(&self, s: &ShutdownSignal) {
        let (Some((run_dir, server)), Some(c)) = (&self.courier, &self.cluster) else {
            return;
        };
        use crate::detect::shutdown_hook::{self, FINAL_STAGE_COMM};
        let pid1_became_shutdown = s.source == crate::signal::Source::Exec
            && s.scope == crate::signal::Scope::Node
            && s.actor
                .as_ref()
                .is_some_and(|a| a.pid == 1 && a.comm == FINAL_STAGE_COMM);
        let Some(verb) = shutdown_hook::verb(s.kind).filter(|_| pid1_became_shutdown) else {
            return;
        };
        let hook = shutdown_hook::signal(verb, FINAL_STAGE_COMM, SystemTime::now());
        let d = self.decider.clone().decide(&hook);
        let Some(ep) = d
            .episode
            .as_ref()
            .filter(|_| matches!(d.action, Action::LastWord | Action::Immediate { .. }))
        else {
            return;
        };
        let record = self.record(&hook, ep);
        let (reason, message) = lastgasp::message(&hook, ep.kind, false);
        let evidence = c
            .lastgasp
            .bodies(reason, &message, &record, SystemTime::now())
            .evidence;
        let kit = match crate::act::courier::credentials(server.as_deref()).await {
            Ok((server, root_certs, token)) => crate::act::courier::Kit {
                server,
                root_certs,
                token,
                node: c.lastgasp.node().to_string(),
                evidence,
            },
            Err(e) => return tracing::warn!("no courier kit: {e:#}"),
        };
        match crate::act::courier::prepare(run_dir, &kit) {
            Ok(()) => tracing::info!(
                episode = ep.id,
                "courier kit left for systemd-shutdown's hook"
            ),
            Err(e) => tracing::warn!("no courier kit: {e:#}"),
        }
    }

    /// Cluster mode whose cluster half joins later, through `coming`
    /// ([`Agent::join_cluster`]).
    pub fn with_cluster_coming(mut self, coming: watch::Receiver<Option<Arc<Cluster>>>) -> Self {
        if self.cluster.is_none() {
            self.cluster_coming = Some(coming);
        }
        self
    }

    /// The cluster half is here: kept, and the previous boot's report goes out.
    fn adopt(&mut self, c: Arc<Cluster>) {
        self.cluster = Some(c.clone());
        self.cluster_coming = None;
        if let Some(p) = self.previous_boot.take() {
            drop(self.deliver_previous_boot(c, p));
        }
    }

    /// The cluster half, waiting at most `bound` for it to join.
    async fn cluster_within(&mut self, bound: Duration) -> Option<Arc<Cluster>> {
        if let Some(c) = &self.cluster {
            return Some(c.clone());
        }
        let mut coming = self.cluster_coming.clone()?;
        let c = match tokio::time::timeout(bound, coming.wait_for(Option::is_some)).await {
            Ok(Ok(c)) => c.clone()?,
            _ => return None,
        };
        self.adopt(c.clone());
        Some(c)
    }

    /// The cluster half is here: the previous boot's report goes out, and the
    /// current episode's action that needed it is taken now. A record with a
    /// proof of death is not sent late in the same boot (the node is alive:
    /// the proof was wrong); it would reach the cluster after the next boot.
    pub async fn join_cluster(&mut self, c: Arc<Cluster>) {
        if self.cluster.is_none() {
            self.adopt(c);
        }
        let Some((s, action, id)) = self.unsent.take() else {
            return;
        };
        let Some(ep) = self.decider.episode().filter(|e| e.id == id).cloned() else {
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

    /// How the last last gasp or last word went, since the last call.
    pub fn take_delivery(&mut self) -> Option<Outcome> {
        self.last_delivery.take()
    }

    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.decider = Decider::with_policy(policy);
        self
    }

    /// How the host is asked whether a shutdown is under way, and whether it
    /// can be reached at all.
    pub fn with_host(
        mut self,
        query: HostQuery,
        reachable: Arc<dyn Fn() -> bool + Send + Sync>,
    ) -> Self {
        self.host = query;
        self.host_reachable = reachable;
        self
    }

    pub async fn handle(&mut self, mut s: ShutdownSignal) -> Result<Decision> {
        let queued_ns = clock::boottime_ns().saturating_sub(s.boot_ns);
        let t = std::time::Instant::now();
        // Before the decision, while the actor may still run. Walking the
        // cgroup tree for a process already gone is slow on a big node: not
        // for records that leave no time.
        let hurry = crate::decide::leaves_no_time(&s);
        if let Some(a) = s.actor.as_mut() {
            actor::enrich_with(a, !hurry);
        }
        let enriched = t.elapsed();
        if let Some(l) = &self.logind {
            self.decider.set_lock_held(l.lock_held());
        }
        self.decider.set_host_reachable((self.host_reachable)());
        let d = self.decider.decide(&s);
        self.metrics.count_detection(&s);
        self.metrics.count_decision(&d);
        let decided = t.elapsed();
        // On disk before anything acts on it: the machine may die next.
        // Records that change nothing are synced in batches (each tick). The
        // last gasp does not wait for the disk: a direct reboot(2) leaves
        // less time than a loaded disk's fdatasync, so its patches leave
        // while the record syncs. What the cluster acknowledged and the disk
        // lost is read back from the Node after the next boot (`after_boot`).
        let beside = matches!(d.action, Action::Immediate { .. } | Action::LastWord)
            && self.cluster.is_some();
        let durability = if acts(&d.action) && !beside {
            Durability::Now
        } else {
            Durability::Batched
        };
        let sync = {
            let mut audit = self.audit.lock().await;
            match audit.append_as(&s, Some(&d), durability) {
                Err(e) => {
                    self.metrics.audit_failures.inc();
                    tracing::error!("audit record NOT written: {e:#}");
                    None
                }
                Ok(_) if beside => match audit.sync_beside() {
                    Ok(job) => Some(tokio::task::spawn_blocking(job)),
                    Err(e) => {
                        tracing::warn!("{e:#}: syncing before the last gasp");
                        if let Err(e) = audit.flush() {
                            self.metrics.audit_failures.inc();
                            tracing::error!("audit record NOT synced: {e:#}");
                        }
                        None
                    }
                },
                Ok(_) => None,
            }
        };
        let audited = t.elapsed();
        if self.print {
            let mut v = serde_json::to_value(&s)?;
            v["decision"] = json!(d.action);
            println!("{v}");
        }
        let printed = t.elapsed();
        // Where the time from the kernel's record to stdout goes (the bench
        // reads these: `cargo xtask bench stdout`).
        tracing::debug!(target: "lastgasp::timing", queued_us = queued_ns / 1000,
            enrich_us = enriched.as_micros() as u64, decide_us = (decided - enriched).as_micros() as u64,
            audit_us = (audited - decided).as_micros() as u64, print_us = (printed - audited).as_micros() as u64,
            "handled");
        tracing::info!(source = %s.source, kind = %s.kind, forced = s.forced, scope = %s.scope,
            pid = s.actor.as_ref().map(|a| a.pid), comm = s.actor.as_ref().map(|a| a.comm.as_str()),
            action = %d.action, episode = d.episode.as_ref().map(|e| e.id), "shutdown signal");
        self.leave_courier_kit(&s).await;
        self.act(Some(&s), &d).await;
        if let Some(sync) = sync {
            let synced = sync.await.map_err(anyhow::Error::from).and_then(|r| r);
            if let Err(e) = synced {
                self.metrics.audit_failures.inc();
                tracing::error!("audit record NOT synced: {e:#}");
            }
        }
        Ok(d)
    }

    /// Time passes (the loop calls this every second): a pending request may
    /// expire, an episode past its expected end is checked with the host
    /// (the answer comes back through [`Agent::next_answer`]).
    pub async fn tick(&mut self, now: SystemTime) {
        if let Err(e) = self.audit.lock().await.flush() {
            self.metrics.audit_failures.inc();
            tracing::error!("audit records NOT synced: {e:#}");
        }
        match self.decider.tick(now) {
            Tick::Nothing => {}
            Tick::Decided(d) => self.decided(d).await,
            Tick::AskHost(id) => {
                let (query, tx) = (self.host.clone(), self.answers.0.clone());
                tokio::spawn(async move {
                    let _ = tx.send((id, query().await)).await;
                });
            }
        }
    }

    /// The host's answer to the last check (and the episode it is about),
    /// when it comes.
    pub async fn next_answer(&mut self) -> Answer {
        match self.answers.1.recv().await {
            Some(a) => a,
            // The agent holds a sender: never closed.
            None => std::future::pending().await,
        }
    }

    pub async fn host_answer(&mut self, (episode, answer): Answer) {
        tracing::info!(episode, ?answer, "host: is a shutdown under way?");
        if let Some(d) = self.decider.host_answer(episode, answer, SystemTime::now()) {
            self.decided(d).await;
        }
    }

    /// A decision made by time, not by a signal.
    async fn decided(&mut self, d: Decision) {
        self.metrics.count_decision(&d);
        tracing::warn!(action = %d.action, episode = d.episode.as_ref().map(|e| e.id), "episode ended without a shutdown");
        self.act(None, &d).await;
    }

    async fn act(&mut self, s: Option<&ShutdownSignal>, d: &Decision) {
        let Some(ep) = d.episode.clone() else { return };
        if self.cluster_coming.is_some() {
            match (&d.action, s) {
                (Action::Graceful { .. } | Action::Warn { .. }, Some(s)) => {
                    // Held until the cluster joins (logind's delay lock stays
                    // taken, up to its own limit).
                    tracing::warn!(episode = ep.id, action = %d.action, "the API server has not answered yet: the action waits for it");
                    self.unsent = Some((s.clone(), d.action.clone(), ep.id));
                    return;
                }
                // The last gasp waits for it within its own bound.
                (Action::Immediate { .. } | Action::LastWord, Some(s)) => {
                    self.unsent = Some((s.clone(), d.action.clone(), ep.id));
                }
                (Action::Cancel | Action::Abandon { .. } | Action::Expire { .. }, _) => {
                    self.unsent = None;
                }
                _ => {}
            }
        }
        match &d.action {
            Action::Graceful { .. } => {
                if let Some(s) = s {
                    self.start_graceful(s, ep);
                }
            }
            Action::Immediate { escalated } => {
                self.stop_graceful();
                if let Some(s) = s {
                    self.last_gasp(s, &ep, *escalated).await;
                }
            }
            // The kernel goes down: the record once more, with its proof.
            Action::LastWord => {
                if let Some(s) = s {
                    self.last_gasp(s, &ep, false).await;
                }
            }
            Action::Cancel => {
                self.stop_graceful();
                let (cluster, audit, metrics) = (
                    self.cluster.clone(),
                    self.audit.clone(),
                    self.metrics.clone(),
                );
                let key = EpisodeKey::of(&self.boot_id, &ep);
                tokio::spawn(async move {
                    if let Some(c) = &cluster {
                        let (undone, ()) = tokio::join!(
                            graceful::cancel(&c.node, &ep),
                            c.node.close_record(
                                &key,
                                Closing::Cancelled,
                                "the shutdown was cancelled"
                            ),
                        );
                        if let Err(e) = undone {
                            tracing::error!("undoing the shutdown in the cluster: {e:#}");
                        }
                    }
                    write_outcome(&audit, &metrics, ep.id, Outcome::Cancelled).await;
                });
            }
            Action::Abandon { why } => {
                self.stop_graceful();
                self.unwind(ep, why.clone());
            }
            Action::Expire { why } => {
                if let Some(c) = self.cluster.clone() {
                    let (key, why) = (EpisodeKey::of(&self.boot_id, &ep), why.clone());
                    tokio::spawn(async move {
                        c.node.close_record(&key, Closing::Expired, &why).await;
                    });
                }
                self.outcome(ep.id, Outcome::Expired { why: why.clone() })
                    .await;
            }
            Action::Warn { due } => {
                if let Some(c) = self.cluster.clone() {
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
                            tracing::error!("announcing the scheduled shutdown: {e:#}");
                        }
                    });
                }
            }
            Action::Join | Action::AuditOnly { .. } | Action::Pending { .. } => {}
        }
    }

    /// The shutdown did not come: every mark the episode made is undone, and
    /// the delay lock is taken again for the next one.
    fn unwind(&mut self, ep: Episode, why: String) {
        let (cluster, audit, metrics, logind) = (
            self.cluster.clone(),
            self.audit.clone(),
            self.metrics.clone(),
            self.logind.clone(),
        );
        let key = EpisodeKey::of(&self.boot_id, &ep);
        tokio::spawn(async move {
            if let (Some(c), true) = (&cluster, ep.marked) {
                let msg = format!("episode {}: {why}", ep.id);
                let (marks, ()) = tokio::join!(
                    unmark(&c.node, &msg),
                    c.node.close_record(&key, Closing::Abandoned, &why),
                );
                if let Err(e) = marks {
                    tracing::error!("undoing the abandoned shutdown's marks: {e:#}");
                }
            }
            write_outcome(&audit, &metrics, ep.id, Outcome::Abandoned { why }).await;
            if let Some(l) = logind {
                l.relock();
            }
        });
    }

    fn record(&self, s: &ShutdownSignal, ep: &Episode) -> ShutdownRecord {
        ShutdownRecord::new(&self.boot_id, s, ep)
    }

    fn start_graceful(&mut self, s: &ShutdownSignal, ep: Episode) {
        self.stop_graceful();
        let record = self.record(s, &ep);
        let (cluster, logind, audit, metrics) = (
            self.cluster.clone(),
            self.logind.clone(),
            self.audit.clone(),
            self.metrics.clone(),
        );
        let id = ep.id;
        let run = tokio::spawn(async move {
            let outcome = match &cluster {
                Some(c) => {
                    match graceful::run(&c.node, &c.graceful, &ep, &record, &metrics).await {
                        Ok(r) => Outcome::GracefulDone {
                            terminated: r.terminated(),
                            remaining: r.remaining(),
                        },
                        Err(e) => {
                            tracing::error!("graceful path: {e:#}");
                            Outcome::GracefulDone {
                                terminated: 0,
                                remaining: 0,
                            }
                        }
                    }
                }
                // Standalone: nothing to stop but the record, already written.
                None => Outcome::GracefulDone {
                    terminated: 0,
                    remaining: 0,
                },
            };
            write_outcome(&audit, &metrics, ep.id, outcome).await;
        });
        // The run is joined: a panic is reported, and the lock goes anyway.
        let (audit, metrics) = (self.audit.clone(), self.metrics.clone());
        let abort = run.abort_handle();
        let joiner = tokio::spawn(async move {
            if let Err(e) = run.await {
                if e.is_panic() {
                    tracing::error!("the graceful run panicked: {e}");
                    let outcome = Outcome::GracefulDone {
                        terminated: 0,
                        remaining: 0,
                    };
                    write_outcome(&audit, &metrics, id, outcome).await;
                } else {
                    // Stopped by a cancel or an escalation: they release.
                    return;
                }
            }
            if let Some(l) = logind {
                l.release();
            }
        });
        self.graceful = Some((abort, joiner));
    }

    /// A graceful run is under way (it ends by releasing the logind lock).
    pub fn graceful_running(&self) -> bool {
        self.graceful
            .as_ref()
            .is_some_and(|(_, j)| !j.is_finished())
    }

    fn stop_graceful(&mut self) {
        if let Some((run, joiner)) = self.graceful.take() {
            run.abort();
            joiner.abort();
        }
    }

    async fn last_gasp(&mut self, s: &ShutdownSignal, ep: &Episode, escalated: bool) {
        let started = Instant::now();
        let coming = self.cluster_coming.is_some();
        let Some(c) = self.cluster_within(LAST_GASP_BOUND).await else {
            if coming {
                let error = format!(
                    "the API server has not answered since the agent started (waited {:?})",
                    started.elapsed()
                );
                self.metrics.last_gasp_failures.inc();
                tracing::error!(
                    "last gasp failed: {error}; it will be delivered after the next boot"
                );
                let outcome = Outcome::LastGaspFailed { error };
                self.last_delivery = Some(outcome.clone());
                self.outcome(ep.id, outcome).await;
            }
            if let Some(l) = &self.logind {
                l.release();
            }
            return;
        };
        // Sent now: nothing is left for the join.
        self.unsent = None;
        let record = self.record(s, ep);
        let (reason, message) = lastgasp::message(s, ep.kind, escalated);
        let bodies = c
            .lastgasp
            .bodies(reason, &message, &record, SystemTime::now());
        // The node's expected end, counted from the detection (its monotonic
        // time is not kept: from now, which is later by the handling).
        let death = Instant::now() + decide::expected_life(s, LAST_GASP_BOUND);
        let budget = LAST_GASP_BOUND.saturating_sub(started.elapsed());
        let sent = tokio::time::timeout(budget, c.lastgasp.send(&bodies, death)).await;
        let outcome = match sent {
            Ok(Ok(sent)) => {
                // Delivered: the evidence was accepted (the condition may follow).
                let accepted =
                    SystemTime::now() - sent.started.elapsed().saturating_sub(sent.evidence_done);
                let ms = accepted
                    .duration_since(s.at)
                    .map(|d| d.as_secs_f64() * 1e3)
                    .unwrap_or(0.0);
                self.metrics
                    .last_gasp_latency
                    .observe(since_detection(s, ms));
                let rest: Vec<String> = [&sent.condition, &sent.taint]
                    .into_iter()
                    .filter_map(|r| r.as_ref().err().cloned())
                    .collect();
                if rest.is_empty() {
                    tracing::info!(
                        ms = format!("{ms:.2}"),
                        tries = sent.tries,
                        "last gasp delivered"
                    );
                } else {
                    tracing::info!(
                        ms = format!("{ms:.2}"),
                        tries = sent.tries,
                        "last gasp delivered (the evidence; {})",
                        rest.join("; ")
                    );
                }
                Outcome::LastGaspDelivered { ms }
            }
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {}s", LAST_GASP_BOUND.as_secs_f64()),
                };
                self.metrics.last_gasp_failures.inc();
                tracing::error!(
                    "last gasp failed: {error}; it will be delivered after the next boot"
                );
                Outcome::LastGaspFailed { error }
            }
        };
        self.last_delivery = Some(outcome.clone());
        self.outcome(ep.id, outcome).await;
        if let Some(l) = &self.logind {
            l.release();
        }
        // The Event, like the condition, only while the node is expected to
        // live: past that, in a zone that went dark at once, it would only
        // stand in line before another node's evidence (the next boot's
        // PreviousBoot Event tells the story).
        if Instant::now() < death {
            tokio::spawn(async move {
                if let Err(e) = c.node.event(EventType::Warning, "Shutdown", message).await {
                    tracing::warn!("last gasp event: {e:#}");
                }
            });
        }
    }

    /// At start: how did the previous boot end? Reported as an Event (and a
    /// log line), with whatever did not reach the cluster then; then the
    /// agent's own taint and condition are cleared once the node is Ready.
    pub async fn after_boot(&mut self, boot_id: &str) -> Result<Option<AfterBoot>> {
        let contents = {
            let mut audit = self.audit.lock().await;
            let path = audit.path().to_path_buf();
            audit.agent_start()?;
            crate::act::audit::read(&path)?
        };
        let prev = report::previous_boot(&contents.records, boot_id).map(str::to_string);
        for end in contents
            .records
            .iter()
            .map(|r| r.boot_id.as_str())
            .collect::<std::collections::BTreeSet<_>>()
        {
            // The previous boot is counted once the Node has been read.
            let later = (self.cluster.is_some() || self.cluster_coming.is_some())
                && Some(end) == prev.as_deref();
            if end != boot_id && !later {
                let r = report::classify(&contents.records, end);
                self.metrics.count_boot_end(r.end.as_str());
            }
        }
        let Some(prev) = prev else {
            return Ok(None);
        };
        let r = report::classify(&contents.records, &prev);
        let pstore = report::pstore(std::path::Path::new("/sys/fs/pstore"), 3);
        let note = previous_boot_note(&r, &pstore);
        tracing::info!(
            boot = prev,
            end = r.end.as_str(),
            undelivered = r.undelivered,
            "{note}"
        );
        let previous = PreviousBoot {
            prev,
            current: boot_id.to_string(),
            report: r.clone(),
            records: contents.records,
            pstore,
        };
        let delivery = match self.cluster.clone() {
            Some(c) => Some(self.deliver_previous_boot(c, previous)),
            None => {
                if self.cluster_coming.is_some() {
                    self.previous_boot = Some(previous);
                }
                None
            }
        };
        Ok(Some(AfterBoot {
            report: r,
            delivery,
        }))
    }

    /// The cluster half of the previous boot's report, beside the loop: with
    /// the API server slow its retries (seconds) must not delay the audit of
    /// the next shutdown.
    fn deliver_previous_boot(&self, c: Arc<Cluster>, p: PreviousBoot) -> JoinHandle<BootReport> {
        let (audit, metrics, host) = (self.audit.clone(), self.metrics.clone(), self.host.clone());
        let PreviousBoot {
            prev,
            current,
            report: local,
            mut records,
            pstore,
        } = p;
        tokio::spawn(async move {
            // A last gasp the cluster acknowledged while its record (or its
            // outcome) never reached the disk: the Node still holds it.
            let mut report = local;
            let mut found = false;
            let on_node = match c.node.record().await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("reading the Node's shutdown record: {e:#}");
                    None
                }
            };
            match on_node {
                Some(rec) if rec.boot_id == prev => {
                    let ep = report::episode_of(&rec).map_or(0, |e| e.id);
                    let outcome = Outcome::FoundOnNode {
                        boot_id: prev.clone(),
                        record: serde_json::to_value(&rec).unwrap_or_default(),
                    };
                    records.push(crate::act::audit::Record {
                        boot_id: current.clone(),
                        seq: 0,
                        written_at: SystemTime::now(),
                        entry: crate::act::audit::Entry::Outcome {
                            episode: ep,
                            outcome: outcome.clone(),
                        },
                    });
                    let with = report::classify(&records, &prev);
                    if with != report {
                        write_outcome(&audit, &metrics, ep, outcome).await;
                        report = with;
                        found = true;
                    }
                }
                Some(rec) if rec.boot_id == current && rec.closed.is_none() => {
                    close_orphan(&c, &host, rec).await;
                }
                _ => {}
            }
            metrics.count_boot_end(report.end.as_str());
            let mut note = previous_boot_note(&report, &pstore);
            if found {
                note.push_str(
                    "; the audit log lacked it: found on the Node (the cluster had it before the boot ended)",
                );
            }
            // The pod's log says it too (`kubectl logs`, and the VM runner).
            tracing::info!(boot = prev, end = report.end.as_str(), "{note}");
            let type_ = if report.end == BootEnd::Graceful {
                EventType::Normal
            } else {
                EventType::Warning
            };
            if let Err(e) = c.node.event(type_, "PreviousBoot", note).await {
                tracing::warn!("previous-boot event: {e:#}");
            }
            if let (true, Some(ep)) = (report.undelivered, &report.episode) {
                let record = ShutdownRecord::late(&prev, ep, SystemTime::now());
                match c.node.set_earlier_record(&record, &current).await {
                    Ok(true) => {
                        let late = Outcome::DeliveredLate {
                            boot_id: prev.clone(),
                        };
                        write_outcome(&audit, &metrics, ep.id, late).await;
                    }
                    Ok(false) => tracing::warn!(
                        "the previous boot's record was not delivered: the node already carries this boot's"
                    ),
                    Err(e) => tracing::warn!("delivering the previous boot's record: {e:#}"),
                }
            }
            let clear = current.clone();
            tokio::spawn(async move {
                if let Err(e) = c.node.clear_when_ready(&clear).await {
                    tracing::warn!("clearing the shutdown marks: {e:#}");
                }
            });
            report
        })
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    async fn outcome(&self, episode: u32, outcome: Outcome) {
        write_outcome(&self.audit, &self.metrics, episode, outcome).await;
    }
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
async fn close_orphan(c: &Cluster, host: &HostQuery, rec: ShutdownRecord) {
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
        tracing::error!("undoing an earlier start's marks: {e:#}");
    }
}

async fn write_outcome(
    audit: &tokio::sync::Mutex<AuditLog>,
    metrics: &Metrics,
    episode: u32,
    outcome: Outcome,
) {
    if let Err(e) = audit.lock().await.outcome(episode, outcome) {
        metrics.audit_failures.inc();
        tracing::error!("audit outcome NOT written: {e:#}");
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
        note.push_str(&format!("; pods terminated {t}, still running {rem}"));
    }
    if r.end == BootEnd::Unannounced {
        for (name, first) in pstore {
            note.push_str(&format!("; pstore {name}: {}", first.replace('\n', " | ")));
        }
    }
    note
}

/// Whether a decision moves anything (its record must be durable first).
fn acts(a: &Action) -> bool {
    !matches!(
        a,
        Action::AuditOnly { .. } | Action::Pending { .. } | Action::Join
    )
}

/// Seconds from the detection to now: on the kernel's boot clock when the
/// signal carries it (eBPF records are stamped in the kernel), else from the
/// wall clock (`wall_ms`, already measured).
fn since_detection(s: &ShutdownSignal, wall_ms: f64) -> f64 {
    if s.boot_ns > 0 {
        let now = crate::detect::clock::boottime_ns();
        if now >= s.boot_ns {
            return (now - s.boot_ns) as f64 / 1e9;
        }
    }
    wall_ms / 1e3
}
