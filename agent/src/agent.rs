//! The agent's one loop: each `ShutdownSignal` is enriched, decided, audited
//! (fsync'd) and then acted on. Detection → decision → action, one way.
use std::{sync::Arc, time::SystemTime};

use anyhow::Result;
use kube::runtime::events::EventType;
use serde_json::json;
use tokio::task::JoinHandle;

use crate::{
    act::{
        audit::{AuditLog, Outcome},
        kube::{
            graceful::{self, GracefulOptions},
            lastgasp::LastGasp,
            NodeClient,
        },
        metrics::Metrics,
    },
    decide::{Action, Decider, Decision, Episode},
    detect::{actor, logind::LogindHandle},
    report::{self, BootEnd, BootReport},
    signal::ShutdownSignal,
};

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
    graceful: Option<JoinHandle<()>>,
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
            audit: Arc::new(tokio::sync::Mutex::new(audit)),
            cluster,
            logind,
            metrics,
            print,
            graceful: None,
        }
    }

    pub async fn handle(&mut self, mut s: ShutdownSignal) -> Result<Decision> {
        if let Some(l) = &self.logind {
            self.decider.set_lock_held(l.lock_held());
        }
        let d = self.decider.decide(&s);
        self.metrics.count_detection(&s);
        self.metrics.count_decision(&d);
        if let Some(a) = s.actor.as_mut() {
            actor::enrich_with(a, !matches!(d.action, Action::Immediate { .. }));
        }
        // On disk before anything acts on it: the machine may die next.
        if let Err(e) = self.audit.lock().await.append(&s, Some(&d)) {
            self.metrics.audit_failures.inc();
            tracing::error!("audit record NOT written: {e:#}");
        }
        if self.print {
            let mut v = serde_json::to_value(&s)?;
            v["decision"] = json!(d.action);
            println!("{v}");
        }
        tracing::info!(source = ?s.source, kind = ?s.kind, forced = s.forced, scope = ?s.scope,
            pid = s.actor.as_ref().map(|a| a.pid), comm = s.actor.as_ref().map(|a| a.comm.as_str()),
            action = ?d.action, episode = d.episode.as_ref().map(|e| e.id), "shutdown signal");
        self.act(&s, &d).await;
        Ok(d)
    }

    async fn act(&mut self, s: &ShutdownSignal, d: &Decision) {
        let Some(ep) = d.episode.clone() else { return };
        match &d.action {
            Action::Graceful { .. } => self.start_graceful(s, ep),
            Action::Immediate { escalated } => {
                self.stop_graceful();
                self.last_gasp(s, &ep, *escalated).await;
            }
            Action::Cancel => {
                self.stop_graceful();
                if let Some(c) = &self.cluster {
                    if let Err(e) = graceful::cancel(&c.node, &ep).await {
                        tracing::error!("undoing the shutdown in the cluster: {e:#}");
                    }
                }
                self.outcome(ep.id, Outcome::Cancelled).await;
            }
            Action::Warn { due } => {
                if let Some(c) = &self.cluster {
                    let when = due
                        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                        .unwrap_or("later".into());
                    let msg = format!("{:?} scheduled for {when}", ep.kind).to_lowercase();
                    let (a, b) = tokio::join!(
                        c.node.set_condition(true, "ScheduledShutdown", &msg),
                        c.node
                            .event(EventType::Normal, "ScheduledShutdown", msg.clone()),
                    );
                    if let Err(e) = a.and(b) {
                        tracing::error!("announcing the scheduled shutdown: {e:#}");
                    }
                }
            }
            Action::Join | Action::AuditOnly { .. } => {}
        }
    }

    fn start_graceful(&mut self, s: &ShutdownSignal, ep: Episode) {
        self.stop_graceful();
        let record = json!({ "episode": ep, "signal": s });
        let (cluster, logind, audit, metrics) = (
            self.cluster.clone(),
            self.logind.clone(),
            self.audit.clone(),
            self.metrics.clone(),
        );
        self.graceful = Some(tokio::spawn(async move {
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
            if let Err(e) = audit.lock().await.outcome(ep.id, outcome) {
                metrics.audit_failures.inc();
                tracing::error!("audit outcome NOT written: {e:#}");
            }
            if let Some(l) = logind {
                l.release();
            }
        }));
    }

    /// A graceful run is under way (it ends by releasing the logind lock).
    pub fn graceful_running(&self) -> bool {
        self.graceful.as_ref().is_some_and(|t| !t.is_finished())
    }

    fn stop_graceful(&mut self) {
        if let Some(t) = self.graceful.take() {
            t.abort();
        }
    }

    async fn last_gasp(&mut self, s: &ShutdownSignal, ep: &Episode, escalated: bool) {
        let Some(c) = self.cluster.clone() else {
            if let Some(l) = &self.logind {
                l.release();
            }
            return;
        };
        let how = if s.forced {
            "ForcedShutdown"
        } else {
            "ImmediateShutdown"
        };
        let actor = s
            .actor
            .as_ref()
            .map(|a| format!("{} ({})", a.comm, a.pid))
            .unwrap_or_default();
        let message = format!(
            "{:?} with no time left via {:?}{} by {actor}",
            ep.kind,
            s.source,
            if escalated {
                " during a graceful shutdown"
            } else {
                ""
            }
        )
        .to_lowercase();
        let record = json!({ "episode": ep, "signal": s });
        let (status, spec) = c.lastgasp.bodies(how, &message, &record, SystemTime::now());
        let outcome = match c.lastgasp.send(&status, &spec).await {
            Ok(_) => {
                let ms = SystemTime::now()
                    .duration_since(s.at)
                    .map(|d| d.as_secs_f64() * 1e3)
                    .unwrap_or(0.0);
                self.metrics
                    .last_gasp_latency
                    .observe(since_detection(s, ms));
                tracing::info!(ms = format!("{ms:.2}"), "last gasp delivered");
                Outcome::LastGaspDelivered { ms }
            }
            Err(e) => {
                self.metrics.last_gasp_failures.inc();
                tracing::error!(
                    "last gasp failed: {e:#}; it will be delivered after the next boot"
                );
                Outcome::LastGaspFailed {
                    error: format!("{e:#}"),
                }
            }
        };
        self.outcome(ep.id, outcome).await;
        if let Some(l) = &self.logind {
            l.release();
        }
        if let Err(e) = c.node.event(EventType::Warning, "Shutdown", message).await {
            tracing::warn!("last gasp event: {e:#}");
        }
    }

    /// At start: how did the previous boot end? Reported as an Event (and a
    /// log line), with whatever did not reach the cluster then; then the
    /// agent's own taint and condition are cleared once the node is Ready.
    pub async fn after_boot(&mut self, boot_id: &str) -> Result<Option<BootReport>> {
        let contents = {
            let mut audit = self.audit.lock().await;
            let path = audit.path().to_path_buf();
            audit.agent_start()?;
            crate::act::audit::read(&path)?
        };
        for end in contents
            .records
            .iter()
            .map(|r| r.boot_id.as_str())
            .collect::<std::collections::BTreeSet<_>>()
        {
            if end != boot_id {
                let r = report::classify(&contents.records, end);
                self.metrics.count_boot_end(r.end);
            }
        }
        let Some(prev) = report::previous_boot(&contents.records, boot_id) else {
            return Ok(None);
        };
        let r = report::classify(&contents.records, prev);
        let pstore = report::pstore(std::path::Path::new("/sys/fs/pstore"), 3);
        let mut note = match &r.episode {
            Some(ep) => format!(
                "previous boot {prev} ended {} ({:?}, episode {}): {}",
                r.end.as_str(),
                ep.kind,
                ep.id,
                ep.timeline.iter().map(|e| e.summary.as_str()).collect::<Vec<_>>().join("; ")
            ),
            None => format!("previous boot {prev} ended unannounced: no shutdown was seen (power loss, reset, watchdog or panic)"),
        };
        if let (Some(t), Some(rem)) = (r.pods_terminated, r.pods_remaining) {
            note.push_str(&format!("; pods terminated {t}, still running {rem}"));
        }
        if r.end == BootEnd::Unannounced {
            for (name, first) in &pstore {
                note.push_str(&format!("; pstore {name}: {}", first.replace('\n', " | ")));
            }
        }
        tracing::info!(
            boot = prev,
            end = r.end.as_str(),
            undelivered = r.undelivered,
            "{note}"
        );
        let Some(c) = self.cluster.clone() else {
            return Ok(Some(r));
        };
        let type_ = if r.end == BootEnd::Graceful {
            EventType::Normal
        } else {
            EventType::Warning
        };
        if let Err(e) = c.node.event(type_, "PreviousBoot", note).await {
            tracing::warn!("previous-boot event: {e:#}");
        }
        if r.undelivered {
            if let Some(ep) = &r.episode {
                let record =
                    json!({ "episode": ep, "boot_id": prev, "delivered_late": true, "back": true });
                match c.node.set_record(&record).await {
                    Ok(()) => {
                        self.outcome(
                            ep.id,
                            Outcome::DeliveredLate {
                                boot_id: prev.to_string(),
                            },
                        )
                        .await
                    }
                    Err(e) => tracing::warn!("delivering the previous boot's record: {e:#}"),
                }
            }
        }
        let cluster = c.clone();
        tokio::spawn(async move {
            if let Err(e) = cluster.node.clear_when_ready().await {
                tracing::warn!("clearing the shutdown marks: {e:#}");
            }
        });
        Ok(Some(r))
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    async fn outcome(&self, episode: u32, outcome: Outcome) {
        if let Err(e) = self.audit.lock().await.outcome(episode, outcome) {
            self.metrics.audit_failures.inc();
            tracing::error!("audit outcome NOT written: {e:#}");
        }
    }
}

/// Seconds from the detection to now: on the kernel's boot clock when the
/// signal carries it (eBPF records are stamped in the kernel), else from the
/// wall clock (`wall_ms`, already measured).
fn since_detection(s: &ShutdownSignal, wall_ms: f64) -> f64 {
    if s.boot_ns > 0 {
        let now = crate::detect::ebpf::boottime_ns();
        if now >= s.boot_ns {
            return (now - s.boot_ns) as f64 / 1e9;
        }
    }
    wall_ms / 1e3
}
